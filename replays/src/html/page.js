// Hover details on the drift plots: maps the pointer to a step with the
// panels' ranges and shows each series' values there, from #lmrr-data.
(function () {
  "use strict";
  window.addEventListener("error", (e) => { document.documentElement.dataset.lmrrError = String(e.message); });
  const t0 = performance.now();
  const data = JSON.parse(document.getElementById("lmrr-data").textContent);
  const box = document.getElementById("drift-plots");
  const tip = document.getElementById("hover");
  if (box && tip && data.drift) {
    const panels = JSON.parse(box.dataset.panels || "[]");
    const svg = box.querySelector("svg");
    const fmt = (k, v) => k === "top1_agreement" ? (100 * v).toFixed(0) + "%" : Number(v).toExponential(2);
    svg.addEventListener("mousemove", (ev) => {
      const m = svg.getScreenCTM();
      if (!m) return;
      const p = new DOMPoint(ev.clientX, ev.clientY).matrixTransform(m.inverse());
      const panel = panels.find((q) => p.x >= q.px[0] && p.x <= q.px[1] && p.y >= q.py[0] && p.y <= q.py[1]);
      if (!panel) { tip.hidden = true; return; }
      const step = panel.x[0] + (p.x - panel.px[0]) / (panel.px[1] - panel.px[0]) * (panel.x[1] - panel.x[0]);
      const lines = [];
      for (const s of data.drift.series) {
        let best = null;
        for (const q of s.points) { if (q.step <= step) best = q; else break; }
        if (best) lines.push(s.name.padEnd(14) + " steps " + best.step + (best.to > best.step ? ".." + best.to : "") + "  " + fmt(panel.metric, best[panel.metric]));
      }
      if (!lines.length) { tip.hidden = true; return; }
      tip.textContent = panel.metric + " at step " + Math.floor(step) + "\n" + lines.join("\n");
      const r = box.getBoundingClientRect();
      tip.style.left = (ev.clientX - r.left + 14) + "px";
      tip.style.top = (ev.clientY - r.top + 10) + "px";
      tip.hidden = false;
    });
    svg.addEventListener("mouseleave", () => { tip.hidden = true; });
  }
  document.documentElement.dataset.lmrrReady = "1";
  window.addEventListener("load", () => {
    const nav = performance.getEntriesByType("navigation")[0];
    document.documentElement.dataset.lmrrLoadMs = String(Math.round(nav ? nav.loadEventStart : performance.now()));
    document.documentElement.dataset.lmrrScriptMs = String(Math.round(performance.now() - t0));
  });
})();
