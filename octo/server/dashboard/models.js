// octo dashboard, Models view: every servable model with its state, engine, memory and idle expiry; load / unload.
"use strict";
octo.modelsView = (() => {
  const { el, json, bytes, duration, showError } = octo;
  const busy = new Set();  // models with a load/unload under way (their buttons stay disabled)

  async function refresh() {
    try {
      const body = await json("/v1/models");
      octo.setModels(body.data);
      render(body.data);
      showError("models-error", null);
      return body.data;
    } catch (err) {
      showError("models-error", err);
      return null;
    }
  }

  function memory(m) {
    const mem = m.memory || {};
    if (mem.measured_bytes) return bytes(mem.measured_bytes) + " (measured)";
    if (mem.estimated_bytes) return bytes(mem.estimated_bytes) + " (estimated)";
    return "–";
  }

  function expiry(m) {
    if (m.state === "available") return "not loaded";
    if (m.pinned) return "pinned";
    if (m.expires_at) return "in " + duration(m.expires_at - Date.now() / 1000);
    if (m.requests_in_flight) return "busy";
    return m.keep_alive === null || m.keep_alive === undefined ? "never" : "–";
  }

  function render(list) {
    const tbody = document.querySelector("#models-table tbody");
    const rows = list.filter((m) => !m.parent).map((m) => {
      const loaded = m.state !== "available" && m.state !== "unloaded" && m.state !== "failed";
      const name = m.id;
      const action = async (verb) => {
        busy.add(name); render(octo.models());
        try {
          await json(`/v1/models/${encodeURIComponent(name)}/${verb}`, { method: "POST" });
          showError("models-error", null);
        } catch (err) {
          showError("models-error", err);
        } finally {
          busy.delete(name);
          await refresh();
        }
      };
      const b = busy.has(name);
      return el("tr", { "data-model": name },
        el("td", {}, el("strong", { text: name }),
          m.aliases && m.aliases.length ? el("div", { class: "reason", text: "aliases: " + m.aliases.join(", ") }) : null,
          m.source === "catalog" ? el("div", { class: "reason", text: "catalog" }) : null),
        el("td", {}, el("span", { class: "badge s-" + m.state, text: b ? "working…" : m.state }),
          m.reason ? el("div", { class: "reason", text: m.reason }) : null),
        el("td", { text: m.task || "–" }),
        el("td", { text: m.engine || (m.engines ? m.engines.join(", ") : "–") }),
        el("td", { text: memory(m) }),
        el("td", { text: expiry(m) }),
        el("td", { class: "num", text: m.requests_in_flight ?? "–" }),
        el("td", {},
          loaded ? el("button", { type: "button", class: "ghost", disabled: b, "aria-label": `Unload ${name}`,
                                  onclick: () => action("unload") }, "Unload")
            : el("button", { type: "button", disabled: b, "aria-label": `Load ${name}`, onclick: () => action("load") },
                 "Load")));
    });
    // keep keyboard focus on the row's button across a redraw
    const focused = document.activeElement && document.activeElement.closest("#models-table tr");
    const fName = focused && focused.dataset.model;
    tbody.replaceChildren(...rows);
    if (fName) {
      const btn = tbody.querySelector(`tr[data-model="${CSS.escape(fName)}"] button`);
      if (btn) btn.focus();
    }
  }

  document.getElementById("models-refresh").addEventListener("click", refresh);
  return { refresh };
})();
