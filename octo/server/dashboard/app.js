// octo dashboard: tabs (keyboard: arrows, Home, End), the API-key dialog, start-up and refresh timers.
"use strict";
(() => {
  const tabs = [...document.querySelectorAll("[role=tab]")];
  const views = { models: octo.modelsView, engines: octo.enginesView, live: null, playground: octo.modelsView };
  let current = "models";

  octo.setStatus = (text) => { document.getElementById("status").textContent = text; };

  function select(tab, focus) {
    for (const t of tabs) {
      const on = t === tab;
      t.setAttribute("aria-selected", on);
      t.tabIndex = on ? 0 : -1;
      document.getElementById(t.getAttribute("aria-controls")).hidden = !on;
    }
    current = tab.id.slice(4);
    if (focus) tab.focus();
    history.replaceState(null, "", "#" + current);
    octo.liveView.show(current === "live");
    if (current === "engines") octo.enginesView.refresh();
    if (current === "models" || current === "playground") octo.modelsView.refresh();
  }
  tabs.forEach((t, i) => {
    t.addEventListener("click", () => select(t, false));
    t.addEventListener("keydown", (e) => {
      const k = { ArrowRight: i + 1, ArrowLeft: i - 1, Home: 0, End: tabs.length - 1 }[e.key];
      if (k === undefined) return;
      e.preventDefault();
      select(tabs[(k + tabs.length) % tabs.length], true);
    });
  });

  // -- API key: asked for on the first 401, kept in sessionStorage --
  const dialog = document.getElementById("key-dialog");
  document.addEventListener("octo:need-key", () => {
    document.getElementById("key-button").hidden = false;
    if (octo.hasKey()) document.getElementById("key-error").textContent = "That key was refused; enter it again.";
    if (!dialog.open) dialog.showModal();
    document.getElementById("key-input").focus();
  });
  document.getElementById("key-form").addEventListener("submit", () => {
    const input = document.getElementById("key-input");
    octo.setKey(input.value.trim());
    input.value = "";
    document.getElementById("key-error").textContent = "";
  });
  dialog.addEventListener("cancel", (e) => e.preventDefault());  // nothing works without it
  document.getElementById("key-button").addEventListener("click", () => dialog.showModal());

  const start = (location.hash || "").slice(1);
  select(tabs.find((t) => t.id === "tab-" + start) || tabs[0], false);
  octo.liveView.connect();
  setInterval(() => {  // models change (loads, unloads, expiry); the engines view only when open
    if (document.hidden) return;
    if (current === "models") octo.modelsView.refresh();
    else if (current === "engines") octo.enginesView.refresh();
  }, 3000);
  document.addEventListener("visibilitychange", () => { if (!document.hidden && views[current]) views[current].refresh(); });
})();
