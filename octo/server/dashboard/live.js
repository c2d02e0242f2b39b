// octo dashboard, Live view: the server's one-a-second feed (GET /v1/dashboard/live, server-sent events):
// per model requests/s, tokens/s, active and queued sequences, batch occupancy, prefix cache; a 5-minute chart.
"use strict";
octo.liveView = (() => {
  const { el, num, pct, bytes, showError } = octo;
  const WINDOW = 300;  // seconds of history in the chart
  const history = [];  // samples: {t, models: {name: row}}
  let lastAt = 0, visible = false;

  function onSample(sample) {
    lastAt = Date.now();
    if (sample.error) showError("live-error", new Error(sample.error)); else showError("live-error", null);
    history.push({ t: sample.time, models: sample.models || {} });
    while (history.length && history[0].t < sample.time - WINDOW - 5) history.shift();
    syncSelect(Object.keys(sample.models || {}));
    octo.setStatus(summary(sample));
    if (visible) render();
  }

  function summary(sample) {
    const rows = Object.values(sample.models || {}).filter((r) => r.rps !== undefined);
    const tok = rows.reduce((a, r) => a + r.tok_s, 0), act = rows.reduce((a, r) => a + r.active, 0);
    return `${rows.length} loaded · ${num(tok)} tok/s · ${act} active`;
  }

  function syncSelect(names) {
    const sel = document.getElementById("live-model");
    const have = new Set([...sel.options].map((o) => o.value));
    for (const n of names) if (!have.has(n)) sel.append(el("option", { value: n, text: n }));
  }

  function meter(fraction) {  // CSSOM, not a style attribute (the page's CSP allows no inline styles)
    const bar = el("span");
    bar.style.width = Math.round(100 * Math.min(1, fraction)) + "%";
    return el("span", { class: "meter", "aria-hidden": "true" }, bar);
  }

  function sum(rows, key) { return rows.reduce((a, r) => a + (r[key] || 0), 0); }

  function render() {
    const last = history[history.length - 1];
    if (!last) return;
    const rows = Object.entries(last.models);
    const loaded = rows.filter(([, r]) => r.rps !== undefined).map(([, r]) => r);
    const hits = loaded.reduce((a, r) => a + (r.cache.hits || 0), 0);
    const looks = loaded.reduce((a, r) => a + (r.cache.hits || 0) + (r.cache.misses || 0), 0);
    const cacheBytes = loaded.reduce((a, r) => a + (r.cache.bytes || 0), 0);
    const maxBatch = sum(loaded, "max_batch");
    const card = (k, v, id) => el("div", { class: "card", id }, el("div", { class: "v", text: v }), el("div", { class: "k", text: k }));
    document.getElementById("live-totals").replaceChildren(
      card("requests / s", num(sum(loaded, "rps"), 2), "live-rps"),
      card("tokens / s", num(sum(loaded, "tok_s")), "live-toks"),
      card("active sequences", sum(loaded, "active"), "live-active"),
      card("queued", sum(loaded, "queued"), "live-queued"),
      card("batch occupancy", maxBatch ? pct(sum(loaded, "active") / maxBatch) : "–", "live-occupancy"),
      card("prefix-cache hit rate", looks ? pct(hits / looks) : "–", "live-hit"),
      card("prefix-cache bytes", bytes(cacheBytes), "live-cache-bytes"));
    document.querySelector("#live-table tbody").replaceChildren(...rows.map(([name, r]) => r.rps === undefined
      ? el("tr", {}, el("td", { text: name }), el("td", { colspan: 8, class: "hint", text: r.state }))
      : el("tr", { "data-model": name },
        el("td", {}, el("strong", { text: name })),
        el("td", { class: "num", text: num(r.rps, 2) }), el("td", { class: "num", text: num(r.tok_s) }),
        el("td", { class: "num", text: `${r.active} / ${r.max_batch}` }), el("td", { class: "num", text: r.queued }),
        el("td", {}, meter(r.occupancy), pct(r.occupancy)),
        el("td", { class: "num", text: r.cache.enabled ? pct(r.cache.hit_rate) : "off" }),
        el("td", { class: "num", text: r.cache.enabled ? bytes(r.cache.bytes) : "–" }),
        el("td", { class: "num", text: `${num(r.total_processed, 0)} req · ${num(r.generated_tokens, 0)} tok` }))));
    const which = document.getElementById("live-model").value;
    const pick = (s, key) => which ? ((s.models[which] || {})[key] || 0)
      : Object.values(s.models).reduce((a, r) => a + (r[key] || 0), 0);
    const series = [
      { label: "tok/s", cls: "l1", points: history.map((s) => [s.t, pick(s, "tok_s")]) },
      { label: "req/s", cls: "l2", points: history.map((s) => [s.t, pick(s, "rps")]) },
    ];
    document.getElementById("live-chart").replaceChildren(octo.charts.lines(series, last.t, WINDOW));
  }

  async function connect() {
    for (;;) {
      try {
        await octo.sse("/v1/dashboard/live", { method: "GET" }, onSample);
        showError("live-error", new Error("The live feed ended; reconnecting…"));
      } catch (err) {
        showError("live-error", err);
        octo.setStatus("disconnected");
      }
      await new Promise((r) => setTimeout(r, 2000));
    }
  }

  setInterval(() => {
    const age = lastAt ? (Date.now() - lastAt) / 1000 : null;
    document.getElementById("live-age").textContent = age === null ? "" : age < 3 ? "live" : `no data for ${Math.round(age)} s`;
  }, 1000);
  document.getElementById("live-model").addEventListener("change", render);
  return { connect, show(v) { visible = v; if (v) render(); } };
})();
