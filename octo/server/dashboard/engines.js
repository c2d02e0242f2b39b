// octo dashboard, Engines view: every engine (available or why not) and the start-up benchmark of each model.
"use strict";
octo.enginesView = (() => {
  const { el, json, num, showError } = octo;

  async function refresh() {
    try {
      const body = await json("/v1/engines");
      render(body);
      showError("engines-error", null);
    } catch (err) {
      showError("engines-error", err);
    }
  }

  function render(body) {
    const rows = body.data || [];
    document.querySelector("#engines-table tbody").replaceChildren(...rows.map((e) => el("tr", {},
      el("td", {}, el("strong", { text: e.name })),
      el("td", {}, el("span", { class: "badge " + (e.available ? "s-yes" : "s-no"), text: e.available ? "yes" : "no" })),
      el("td", { text: (e.tasks || []).join(", ") || "–" }),
      el("td", { text: (e.formats || []).join(", ") || "–" }),
      el("td", { text: e.batching || "–" }),
      el("td", { text: e.version || "–" }),
      el("td", { class: "reason", text: e.reason || "" }))));
    const models = body.models || [];
    const box = document.getElementById("selection");
    // one model: its engine rows are the top-level ones (each engine is listed once)
    box.replaceChildren(...(models.length ? models.map((m) => selection({ data: body.data, ...m }))
      : [el("p", { class: "hint", text: "No model is loaded." })]));
  }

  function selection(m) {
    const sel = m.selection || {};
    const cands = sel.candidates || [];
    const rows = (m.data || []).filter((r) => r.benchmark && (cands.includes(r.name) || r.active));
    const head = el("h3", {}, m.model + " ", el("span", { class: "hint", text: `serving with ${m.active}` }));
    const reason = el("p", { class: "hint", text: sel.reason || "" });
    if (!rows.length) {
      return el("div", { class: "bench", "data-model": m.model }, head, reason,
        el("p", { class: "hint", text: cands.length > 1 ? "No benchmark results." :
          "One candidate engine: nothing to compare (no benchmark run)." }));
    }
    rows.sort((a, b) => (b.benchmark.score || 0) - (a.benchmark.score || 0));
    const status = (r) => {
      const b = r.benchmark;
      if (b.error) return { failed: true, note: "failed: " + b.error };
      if (b.stopped) return { note: "stopped early: " + b.stopped, short: "stopped early (cannot win)" };
      if (b.unmeasured) return { note: "not measured yet (measured while the model is idle)", short: "not measured yet" };
      return { note: b.cached ? "(cached)" : "" };
    };
    const panel = (title, key, unit, cls) => octo.charts.bars(title, rows.map((r) => {
      const st = status(r), v = r.benchmark[key];
      return { label: r.name, value: r.benchmark.error ? null : v, winner: r.active, failed: st.failed,
               note: r.benchmark.error ? "failed" : v === null || v === undefined ? (st.short || "not measured") : "",
               cls };
    }), unit);
    const panels = el("div", { class: "panels" },
      el("figure", { class: "chart" }, panel("Score", "score", "", "b1")),
      el("figure", { class: "chart" }, panel("Prefill", "prefill_tok_s", "tok/s", "b2")),
      el("figure", { class: "chart" }, panel("Decode", "decode_tok_s", "tok/s", "b3")),
      el("figure", { class: "chart" }, panel("Batched decode", "batch_decode_tok_s", "tok/s", "b2")));
    const table = el("table", {},
      el("caption", { class: "sr-only", text: `Benchmark of ${m.model}` }),
      el("thead", {}, el("tr", {}, ["Engine", "Prefill tok/s", "Decode tok/s", "Batched tok/s", "Threads", "Score",
                                     "Result"].map((h) => el("th", { scope: "col", text: h })))),
      el("tbody", {}, rows.map((r) => {
        const b = r.benchmark, st = status(r);
        return el("tr", { class: r.active ? "winner" : "" },
          el("td", {}, el("strong", { text: r.name })),
          el("td", { class: "num", text: num(b.prefill_tok_s) }), el("td", { class: "num", text: num(b.decode_tok_s) }),
          el("td", { class: "num", text: num(b.batch_decode_tok_s) }), el("td", { class: "num", text: b.threads ?? "–" }),
          el("td", { class: "num", text: num(b.score, 2) }),
          el("td", { class: r.active ? "s-yes" : st.failed ? "s-no" : "", text: r.active
            ? (b.unmeasured ? "★ serving, " + st.short : "★ winner " + st.note) : st.note || "lost" }));
      })));
    return el("div", { class: "bench", "data-model": m.model }, head, reason, panels,
              el("div", { class: "table-wrap" }, table));
  }

  document.getElementById("engines-refresh").addEventListener("click", refresh);
  return { refresh };
})();
