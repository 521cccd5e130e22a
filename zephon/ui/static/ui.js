// zephon ui: draws a run's charts from the page's embedded JSON (plotly.js, served by this
// server) and refreshes the page's content in place every data-refresh seconds.
"use strict";

function pageData() {
  const node = document.getElementById("page-data");
  return node ? JSON.parse(node.textContent) : null;
}

const LAYOUT = { margin: { l: 50, r: 10, t: 10, b: 40 }, showlegend: true,
  legend: { orientation: "h", y: -0.25 }, hovermode: "closest" };

// Up to this many points a chart draws a marker per point (an SVG element each); beyond,
// lines only, one path per trace, which draws in a fraction of the time.
const MAX_MARKERS = 300;

function timeline(data) {
  const rows = data.checkpoints.filter((c) => c.committed_at || c.created_at);
  const byEpoch = {};
  for (const c of rows) {
    if (c.trigger === "emergency") continue;
    (byEpoch[c.epoch] = byEpoch[c.epoch] || []).push(c);
  }
  const markers = rows.length <= MAX_MARKERS;
  const size = (c) => 6 + Math.min(14, Math.log2(1 + (c.bytes || 0)) / 2);
  const traces = Object.entries(byEpoch).map(([epoch, cs]) => ({
    name: `attempt ${epoch}`, type: "scatter", mode: markers ? "lines+markers" : "lines",
    x: cs.map((c) => c.committed_at || c.created_at), y: cs.map((c) => c.step),
    marker: { size: markers ? cs.map(size) : 6 },
    text: cs.map((c) => `step ${c.step}: ${c.state}, ${c.bytes || 0} bytes`),
  }));
  const em = rows.filter((c) => c.trigger === "emergency");
  traces.push({ name: "emergency save", type: "scatter", mode: "markers",
    x: em.map((c) => c.committed_at || c.created_at), y: em.map((c) => c.step),
    marker: { symbol: "x", size: 14, color: "#c62828" } });
  const starts = data.attempts.filter((a) => a.started_at);
  traces.push({ name: "attempt start", type: "scatter", mode: "markers",
    x: starts.map((a) => a.started_at), y: starts.map((a) => a.resumed_from || 0),
    marker: { symbol: "triangle-up", size: 12, color: "#6a1b9a" },
    text: starts.map((a) => `epoch ${a.epoch} resumed from ${a.resumed_from}`) });
  return { traces, layout: { xaxis: { title: "time" }, yaxis: { title: "step" } } };
}

// Bars for a few hundred steps; beyond that one filled line per phase, which draws in a
// fraction of the time (a bar is an SVG element of its own, a line one path per phase).
const MAX_BARS = MAX_MARKERS;

function phases(data) {
  const rows = data.checkpoints.filter((c) => Object.keys(c.timings).length);
  const x = rows.map((c) => c.step);
  const bars = rows.length <= MAX_BARS;
  const traces = data.phases.map((p) => ({ name: p, x, y: rows.map((c) => c.timings[p] || 0),
    ...(bars ? { type: "bar" } : { type: "scatter", mode: "lines", stackgroup: "phases" }) }));
  traces.push({ name: "stall_s", type: "scatter", mode: bars ? "lines+markers" : "lines", x,
    y: rows.map((c) => c.timings.stall_s || 0), line: { color: "#c62828" } });
  return { traces, layout: { barmode: "stack", xaxis: { title: "step" },
    yaxis: { title: "seconds" } } };
}

function tiers(data) {
  const rows = data.checkpoints;
  const lagged = rows.filter((c) => c.upload_lag_s !== null);
  const bars = lagged.length <= MAX_BARS;
  const traces = [{ name: "upload lag (s)", x: lagged.map((c) => c.step),
    y: lagged.map((c) => c.upload_lag_s), marker: { color: "#ef6c00" },
    ...(bars ? { type: "bar" } : { type: "scatter", mode: "lines", fill: "tozeroy" }) }];
  for (const tier of ["memory", "local", "save_dir"]) {
    const held = rows.filter((c) => c.tiers.some((t) => t.tier === tier && t.state === "committed"));
    traces.push({ name: `on ${tier}`, type: "scatter", mode: "markers", yaxis: "y2",
      x: held.map((c) => c.step), y: held.map(() => tier), marker: { symbol: "square", size: 9 } });
  }
  return { traces, layout: { margin: { ...LAYOUT.margin, r: 80 }, xaxis: { title: "step" },
    yaxis: { title: "upload lag (s)" },
    yaxis2: { overlaying: "y", side: "right", type: "category" } } };
}

const CHARTS = { timeline, phases, tiers };

function draw() {
  const data = pageData();
  if (!data || typeof Plotly === "undefined") return;
  for (const node of document.querySelectorAll("[data-chart]")) {
    const chart = CHARTS[node.dataset.chart](data);
    Plotly.react(node, chart.traces, { ...LAYOUT, ...chart.layout },
      { displaylogo: false, responsive: true });
  }
}

async function refresh() {
  try {
    const response = await fetch(location.href, { headers: { accept: "text/html" } });
    if (response.ok) {
      const page = new DOMParser().parseFromString(await response.text(), "text/html");
      const fresh = page.getElementById("content");
      const content = document.getElementById("content");
      // Keep the charts' nodes (plotly redraws them in place); swap everything else.
      for (const node of content.querySelectorAll("[data-chart]")) {
        const twin = fresh.querySelector(`#${node.id}`);
        if (twin) twin.replaceWith(node);
      }
      const focused = document.activeElement && document.activeElement.name;
      if (!focused) content.replaceChildren(...fresh.childNodes);
      draw();
      const stamp = document.getElementById("refreshed");
      if (stamp) stamp.textContent = `refreshed ${new Date().toLocaleTimeString()}`;
    }
  } finally {
    schedule();
  }
}

function schedule() {
  const seconds = Number(document.body.dataset.refresh || 0);
  if (seconds > 0) setTimeout(refresh, seconds * 1000);
}

window.addEventListener("DOMContentLoaded", () => { draw(); schedule(); });
