/* The variance report: each sample's mean reward over its runs, sorted, with the spread of the
   runs, coloured by signal class; a click opens the sample's rollouts. While the diagnostic runs
   the page asks for its progress every few seconds and reloads once it has ended. */
(function () {
  "use strict";

  const config = JSON.parse(document.getElementById("dashboard-config").textContent);
  const node = document.getElementById("chart-samples");
  const status = document.getElementById("charts-status");
  let wasActive = config.active;

  function traces(data) {
    const rank = new Map(data.samples.map((s, i) => [s.sample_index, i + 1]));
    const out = [];
    for (const signal of Object.keys(data.colours)) {
      const samples = data.samples.filter((s) => s.signal === signal && s.mean !== null);
      if (!samples.length) continue;
      const graded = (s) => s.scores.filter((v) => v !== null);
      out.push({
        name: data.labels[signal], type: "scatter", mode: "markers", meta: signal,
        x: samples.map((s) => rank.get(s.sample_index)), y: samples.map((s) => s.mean),
        customdata: samples.map((s) => s.sample_index),
        marker: { color: data.colours[signal], size: 9, symbol: "diamond" },
        error_y: { type: "data", symmetric: false, color: data.colours[signal], thickness: 1.5, width: 3,
          array: samples.map((s) => Math.max(...graded(s)) - s.mean),
          arrayminus: samples.map((s) => s.mean - Math.min(...graded(s))) },
        text: samples.map((s) => `sample ${s.sample_index}: runs ${graded(s).map((v) => v.toFixed(2)).join(", ")}`),
        hovertemplate: "%{text}<br>mean %{y:.3f}<extra>%{fullData.name}</extra>",
      });
    }
    const runs = data.samples.flatMap((s) => s.scores.filter((v) => v !== null)
      .map((v) => [rank.get(s.sample_index), v, s.sample_index]));
    if (runs.length) {
      out.push({ name: "one run", type: "scatter", mode: "markers", meta: "runs",
        x: runs.map((r) => r[0]), y: runs.map((r) => r[1]), customdata: runs.map((r) => r[2]),
        marker: { color: "rgba(87, 96, 106, 0.45)", size: 5 }, hoverinfo: "skip" });
    }
    return out;
  }

  function draw(data) {
    if (typeof Plotly === "undefined" || !node) return;
    const empty = !data.samples.length;
    node.closest("section").querySelector(".empty-note").hidden = !empty;
    if (empty) { node.hidden = true; return; }
    node.hidden = false;
    Plotly.react(node, traces(data), {
      margin: { l: 56, r: 12, t: 8, b: 44 }, hovermode: "closest", font: { color: "#1b1f24", size: 12 },
      xaxis: { title: { text: "samples, sorted by mean reward" }, zeroline: false, automargin: true },
      yaxis: { title: { text: "reward" }, zeroline: false, automargin: true },
      legend: { orientation: "h", y: -0.2 }, paper_bgcolor: "#ffffff", plot_bgcolor: "#ffffff",
    }, { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"] });
    if (!node.dataset.linked) {
      node.dataset.linked = "1";
      node.on("plotly_click", (event) => {
        const point = event.points && event.points[0];
        if (point && point.customdata !== undefined) {
          window.location.assign(`${config.rolloutsUrl}?sample=${encodeURIComponent(point.customdata)}`);
        }
      });
    }
  }

  async function refresh() {
    try {
      const response = await fetch(config.dataUrl, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (response.status === 401) { window.location.assign(`/dashboard/login?next=${encodeURIComponent(location.pathname)}`); return; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const data = await response.json();
      draw(data);
      document.querySelectorAll('[data-field="status"]').forEach((n) => { n.textContent = data.status; n.className = `status status-${data.status}`; });
      const p = data.progress;
      document.querySelectorAll('[data-field="progress"]').forEach((n) => {
        n.textContent = `${p.samples_done}${p.samples_total !== null ? " / " + p.samples_total : ""} samples, ${p.rollouts_done} rollouts`;
      });
      document.body.dataset.diagnosticStatus = data.status;
      if (wasActive && !data.active) { window.location.reload(); return; }  // the summary and verdict are server-rendered
      if (data.active) {
        if (status) status.textContent = `Live: ${data.status}, refreshing every ${config.pollMs / 1000} s.`;
        setTimeout(refresh, config.pollMs);
      }
    } catch (error) {
      if (status) status.textContent = `Could not update (${error.message}); retrying.`;
      setTimeout(refresh, config.pollMs);
    }
  }

  refresh();
})();
