// octo dashboard: API access (the key, JSON calls, SSE over fetch) and small formatting helpers.
// The key lives in this tab's sessionStorage and goes out only as an Authorization header (never in a URL).
"use strict";
window.octo = (() => {
  const KEY = "octo-api-key";
  let key = sessionStorage.getItem(KEY) || "";
  const keyWaiters = [];

  class ApiError extends Error {
    constructor(status, body) {
      const err = (body && body.error) || {};
      super(err.message || `HTTP ${status}`);
      this.status = status; this.code = err.code; this.param = err.param;
    }
  }

  function headers(extra) {
    const h = Object.assign({}, extra || {});
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  // Resolves once a key was entered (after a 401); app.js shows the dialog.
  function needKey() {
    const p = new Promise((resolve) => keyWaiters.push(resolve));
    document.dispatchEvent(new CustomEvent("octo:need-key"));
    return p;
  }

  function setKey(k) {
    key = k;
    if (k) sessionStorage.setItem(KEY, k); else sessionStorage.removeItem(KEY);
    keyWaiters.splice(0).forEach((r) => r());
  }

  // fetch with the key; a 401 asks for the key and retries once it is given
  async function raw(path, opts = {}) {
    for (;;) {
      const resp = await fetch(path, Object.assign({}, opts, { headers: headers(opts.headers), cache: "no-store" }));
      if (resp.status !== 401) return resp;
      await needKey();
    }
  }

  async function json(path, opts = {}) {
    const init = Object.assign({}, opts);
    if (opts.body !== undefined && !(opts.body instanceof FormData)) {
      init.body = JSON.stringify(opts.body);
      init.headers = Object.assign({ "Content-Type": "application/json" }, opts.headers || {});
    }
    const resp = await raw(path, init);
    const text = await resp.text();
    let body = null;
    try { body = text ? JSON.parse(text) : null; } catch (e) { body = { error: { message: text.slice(0, 300) } }; }
    if (!resp.ok) throw new ApiError(resp.status, body);
    return body;
  }

  // Server-sent events over fetch (EventSource cannot send headers): calls onData(obj) per `data:` line.
  async function sse(path, opts, onData, signal) {
    const init = Object.assign({}, opts, { signal });
    if (opts.body !== undefined) {
      init.body = JSON.stringify(opts.body);
      init.headers = Object.assign({ "Content-Type": "application/json" }, opts.headers || {});
    }
    const resp = await raw(path, init);
    if (!resp.ok) {
      let body = null;
      try { body = await resp.json(); } catch (e) { /* not JSON */ }
      throw new ApiError(resp.status, body);
    }
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += value;
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i); buf = buf.slice(i + 2);
        const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }

  // -- formatting --
  function el(tag, attrs, ...kids) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : v);
    }
    for (const k of kids.flat()) if (k !== null && k !== undefined) e.append(k instanceof Node ? k : String(k));
    return e;
  }
  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const u = ["B", "KB", "MB", "GB", "TB"]; let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(n < 10 ? 1 : 0) : n) + " " + u[i];
  }
  function num(v, digits = 1) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    return Number(v).toLocaleString(undefined, { maximumFractionDigits: digits, minimumFractionDigits: 0 });
  }
  function duration(s) {
    if (s === null || s === undefined) return "–";
    s = Math.max(0, Math.round(s));
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }
  function pct(v) { return v === null || v === undefined ? "–" : (100 * v).toFixed(v >= 0.1 ? 0 : 1) + "%"; }

  function showError(id, err) {
    const e = document.getElementById(id);
    if (e) e.textContent = err ? (err.status ? `${err.status}: ` : "") + (err.message || String(err)) : "";
  }

  // the servable models, shared by the views (refreshed by models.js)
  const models = { list: [], listeners: [] };
  function setModels(list) { models.list = list; models.listeners.forEach((f) => f(list)); }
  function onModels(f) { models.listeners.push(f); if (models.list.length) f(models.list); }

  return { json, raw, sse, setKey, hasKey: () => !!key, ApiError, el, bytes, num, duration, pct, showError,
           setModels, onModels, models: () => models.list };
})();
