// octo dashboard: two small SVG charts drawn by hand (no library): horizontal bars and a time series.
"use strict";
octo.charts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  function s(tag, attrs, text) {
    const e = document.createElementNS(NS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // items: [{label, value (number or null), note, winner, failed}]; one bar per item, scaled to the largest.
  function bars(title, items, unit) {
    const rowH = 22, labelW = 84, valueW = 64, w = 300, top = 20;
    const h = top + rowH * items.length + 4;
    const max = Math.max(1e-9, ...items.map((i) => i.value || 0));
    const svg = s("svg", { viewBox: `0 0 ${w} ${h}`, width: "100%", role: "img", class: "bars",
                           "aria-label": `${title}: ` + items.map((i) => `${i.label} ${i.value === null ? i.note
                             : octo.num(i.value) + " " + unit}`).join(", ") });
    svg.append(s("text", { x: 0, y: 13, "font-weight": 600 }, title + (unit ? ` (${unit})` : "")));
    items.forEach((it, k) => {
      const y = top + k * rowH;
      svg.append(s("text", { x: 0, y: y + 15, class: it.winner ? "win" : it.failed ? "fail" : "" },
                   (it.winner ? "★ " : "") + it.label));
      const span = w - labelW - valueW;
      if (it.value !== null && it.value !== undefined) {
        const bw = Math.max(2, (span * it.value) / max);
        svg.append(s("rect", { x: labelW, y: y + 4, width: bw, height: rowH - 8, rx: 3, class: it.cls || "b1" }));
        svg.append(s("text", { x: labelW + bw + 5, y: y + 15 }, octo.num(it.value)));
      } else {
        svg.append(s("text", { x: labelW, y: y + 15, class: it.failed ? "fail" : "muted" }, it.note || "not measured"));
      }
    });
    return svg;
  }

  // series: [{points: [[t (s), v]], cls, label}]; the last `window` seconds up to `now`.
  function lines(series, now, window) {
    const w = 1000, h = 210, l = 46, r = 10, t = 10, b = 22;
    let max = 0;
    for (const se of series) for (const [, v] of se.points) max = Math.max(max, v);
    max = niceMax(max);
    const x = (ts) => l + ((ts - (now - window)) / window) * (w - l - r);
    const y = (v) => h - b - (v / max) * (h - t - b);
    const svg = s("svg", { viewBox: `0 0 ${w} ${h}`, width: "100%", role: "img",
                           "aria-label": series.map((se) => `${se.label}: now ${octo.num(last(se))}`).join("; ") });
    for (const f of [0, 0.5, 1]) {
      svg.append(s("line", { x1: l, x2: w - r, y1: y(max * f), y2: y(max * f), class: "axis" }));
      svg.append(s("text", { x: l - 6, y: y(max * f) + 4, "text-anchor": "end", class: "muted" }, octo.num(max * f)));
    }
    const mins = Math.round(window / 60);
    svg.append(s("text", { x: l, y: h - 5, class: "muted" }, `−${mins} min`));
    svg.append(s("text", { x: w - r, y: h - 5, "text-anchor": "end", class: "muted" }, "now"));
    for (const se of series) {
      const pts = se.points.filter(([ts]) => ts >= now - window);
      if (pts.length < 2) continue;
      const d = pts.map(([ts, v], i) => `${i ? "L" : "M"}${x(ts).toFixed(1)},${y(v).toFixed(1)}`).join("");
      svg.append(s("path", { d, class: se.cls }));
    }
    let lx = l + 8;
    for (const se of series) {
      svg.append(s("line", { x1: lx, x2: lx + 18, y1: t + 6, y2: t + 6, class: se.cls }));
      svg.append(s("text", { x: lx + 22, y: t + 10 }, se.label));
      lx += 30 + se.label.length * 6.5;
    }
    return svg;
  }
  function last(se) { return se.points.length ? se.points[se.points.length - 1][1] : 0; }
  function niceMax(v) {
    if (v <= 0) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 5, 10]) if (v <= m * p) return m * p;
    return 10 * p;
  }

  // a row of small bars for an embedding's first values (centred on zero)
  function vector(values) {
    const w = 320, h = 60, n = values.length, bw = w / n;
    const max = Math.max(1e-9, ...values.map(Math.abs));
    const svg = s("svg", { viewBox: `0 0 ${w} ${h}`, width: "100%", role: "img",
                           "aria-label": `first ${n} values of the embedding` });
    svg.append(s("line", { x1: 0, x2: w, y1: h / 2, y2: h / 2, class: "axis" }));
    values.forEach((v, i) => {
      const bh = (Math.abs(v) / max) * (h / 2 - 2);
      svg.append(s("rect", { x: i * bw + 0.5, y: v >= 0 ? h / 2 - bh : h / 2, width: Math.max(1, bw - 1), height: bh,
                             class: v >= 0 ? "b1" : "b3" }));
    });
    return svg;
  }

  return { bars, lines, vector };
})();
