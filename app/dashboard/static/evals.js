/* The comparison of an eval's runs: mean reward against seconds per item (one point per run, with
   its spreads), tool calls per item by tool (grouped bars), and each item's change in tool calls and
   in reward against the baseline, coloured by quadrant; a click on an item opens its trajectories. */
(function () {
  "use strict";

  const config = JSON.parse(document.getElementById("dashboard-config").textContent);
  const status = document.getElementById("charts-status");
  const layoutBase = {
    margin: { l: 56, r: 12, t: 8, b: 44 }, hovermode: "closest", font: { color: "#1b1f24", size: 12 },
    legend: { orientation: "h", y: -0.22 }, paper_bgcolor: "#ffffff", plot_bgcolor: "#ffffff",
  };
  const options = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"] };
  const label = (run) => run.name || run.id;

  // Shows the chart, or its "no data" note when it has nothing to draw; true when it is drawn.
  function show(node, drawn) {
    node.hidden = !drawn;
    node.closest("figure, section").querySelector(".empty-note").hidden = drawn;
    return drawn;
  }

  function rewardLatency(data) {
    const node = document.getElementById("chart-reward-latency");
    const runs = data.runs.filter((r) => r.mean_reward !== null && r.seconds_mean !== null);
    if (!show(node, runs.length > 0)) return;
    const traces = runs.map((r) => ({
      name: label(r) + (r.id === data.baseline_run_id ? " (baseline)" : ""), type: "scatter",
      mode: "markers+text", meta: r.id, x: [r.seconds_mean], y: [r.mean_reward], text: [label(r)],
      textposition: "top center", marker: { size: 12 },
      error_x: { type: "data", array: [r.seconds_std || 0], thickness: 1.5, width: 4 },
      error_y: { type: "data", array: [r.reward_std || 0], thickness: 1.5, width: 4 },
      hovertemplate: "%{text}<br>reward %{y:.3f}<br>%{x:.2f} s per item<extra></extra>",
    }));
    Plotly.react(node, traces, { ...layoutBase,
      xaxis: { title: { text: "seconds per item" }, zeroline: false, automargin: true, rangemode: "tozero" },
      yaxis: { title: { text: "mean reward" }, zeroline: false, automargin: true } }, options);
  }

  function tools(data) {
    const node = document.getElementById("chart-tools");
    const names = Object.keys(data.runs[0].tool_calls_by_tool);
    if (!show(node, names.length > 0)) return;
    const traces = data.runs.map((r) => ({
      name: label(r), type: "bar", meta: r.id, x: names, y: names.map((t) => r.tool_calls_by_tool[t]),
      hovertemplate: `%{x}: %{y:.2f} calls per item<extra>${label(r).replace(/[<>&]/g, "")}</extra>`,
    }));
    Plotly.react(node, traces, { ...layoutBase, barmode: "group",
      xaxis: { title: { text: "tool" }, automargin: true },
      yaxis: { title: { text: "calls per item" }, rangemode: "tozero", automargin: true } }, options);
  }

  function deltas(data) {
    const node = document.getElementById("chart-deltas");
    const points = data.items.map((item) => [item, item.deltas[config.vs]])
      .filter(([, d]) => d && d.quadrant !== null);
    if (!show(node, points.length > 0)) return;
    const traces = config.quadrants.map((q) => {
      const mine = points.filter(([, d]) => d.quadrant === q);
      return { name: `${q} (${mine.length})`, type: "scatter", mode: "markers", meta: q,
        x: mine.map(([, d]) => d.tool_calls), y: mine.map(([, d]) => d.reward),
        customdata: mine.map(([item]) => item.item_index),
        marker: { color: config.colours[q], size: 11, opacity: 0.8, line: { color: "#ffffff", width: 1 } },
        hovertemplate: "item %{customdata}<br>reward Δ %{y:.3f}<br>tool calls Δ %{x:.2f}<extra>%{fullData.meta}</extra>" };
    }).filter((t) => t.x.length);
    Plotly.react(node, traces, { ...layoutBase,
      xaxis: { title: { text: "tool calls per item: run − baseline" }, zeroline: true, zerolinecolor: "#8c959f", automargin: true },
      yaxis: { title: { text: "reward: run − baseline" }, zeroline: true, zerolinecolor: "#8c959f", automargin: true } }, options);
    if (!node.dataset.linked) {
      node.dataset.linked = "1";
      node.on("plotly_click", (event) => {
        const point = event.points && event.points[0];
        if (point && point.customdata !== undefined) {
          window.location.assign(`${config.itemUrl}${encodeURIComponent(point.customdata)}#trajectories`);
        }
      });
    }
  }

  async function load() {
    try {
      const response = await fetch(config.dataUrl, { credentials: "same-origin", headers: { Accept: "application/json" } });
      if (response.status === 401) { window.location.assign(`/dashboard/login?next=${encodeURIComponent(location.pathname + location.search)}`); return; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const data = await response.json();
      if (typeof Plotly === "undefined") throw new Error("plotly.js did not load");
      rewardLatency(data);
      tools(data);
      deltas(data);
      document.body.dataset.chartsDrawn = "1";
    } catch (error) {
      if (status) status.textContent = `Could not draw the charts (${error.message}).`;
    }
  }

  load();
})();
