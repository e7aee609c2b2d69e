/* The job page: draws the training curves with plotly.js and, while the job is active, asks
   the server for what is new (steps after the last one it has) every few seconds. */
(function () {
  "use strict";

  const configNode = document.getElementById("dashboard-config");
  if (!configNode) return;
  const config = JSON.parse(configNode.textContent);
  const store = {};          // metric key -> {x: [...], y: [...]}
  let lastStep = -1;
  let active = config.active;
  let timer = null;
  let syncing = false;

  const $ = (id) => document.getElementById(id);
  const fmt = (v, digits = 3) => (typeof v === "number" && isFinite(v) ? v.toFixed(digits) : "—");

  // --- series -> traces -------------------------------------------------------------------

  function merge(series) {
    for (const [key, points] of Object.entries(series)) {
      const target = store[key] || (store[key] = { x: [], y: [] });
      for (let i = 0; i < points.x.length; i++) {
        const step = points.x[i];
        if (target.x.length && step <= target.x[target.x.length - 1]) continue; // already have it
        target.x.push(step);
        target.y.push(points.y[i]);
        if (step > lastStep) lastStep = step;
      }
    }
  }

  function smooth(values, weight) {
    if (!weight) return values;
    const out = [];
    let last = null;
    for (const v of values) {
      if (v === null || v === undefined) { out.push(v); continue; }
      last = last === null ? v : last * weight + (1 - weight) * v;
      out.push(last);
    }
    return out;
  }

  function keysFor(series) {
    if (series.key) return store[series.key] ? [[series.key, series.name]] : [];
    return Object.keys(store).filter((k) => k.startsWith(series.prefix) && !series.exclude.includes(k)).sort()
      .map((k) => [k, k.slice(series.prefix.length)]);
  }

  function traces(chart) {
    const weight = parseFloat($("smoothing") ? $("smoothing").value : "0") || 0;
    const share = chart.id === "tool-mix" && $("tool-mix-share") && $("tool-mix-share").checked;
    const prefixed = chart.series.filter((s) => s.prefix).length;
    const out = [];
    for (const series of chart.series) {
      for (const [key, label] of keysFor(series)) {
        const points = store[key];
        const name = series.key ? label : (prefixed > 1 || chart.series.length > 1 ? `${series.name}: ${label}` : label);
        const trace = {
          name, x: points.x.slice(), y: series.markers ? points.y.slice() : smooth(points.y, weight),
          type: "scatter", mode: series.markers || points.x.length < 30 ? "lines+markers" : "lines",
          meta: key, hovertemplate: `%{y:.4g}<extra>${name.replace(/[<>&]/g, "")}</extra>`,
        };
        if (chart.stacked) {
          trace.stackgroup = "one";
          if (share) trace.groupnorm = "percent";
        }
        out.push(trace);
      }
    }
    return out;
  }

  function layout(chart) {
    const share = chart.id === "tool-mix" && $("tool-mix-share") && $("tool-mix-share").checked;
    const yaxis = { title: { text: share ? "share of calls (%)" : chart.y_title }, zeroline: false, automargin: true,
      rangemode: chart.id === "loss" ? "normal" : "tozero" };
    if (chart.percent) yaxis.tickformat = ".0%";
    const xaxis = { title: { text: "step" }, zeroline: false, automargin: true };
    if (lastStep >= 0 && lastStep <= 12) { xaxis.tick0 = 0; xaxis.dtick = 1; }  // steps are whole numbers
    return {
      margin: { l: 56, r: 12, t: 8, b: 40 }, hovermode: "x unified", uirevision: chart.id, xaxis,
      yaxis, legend: { orientation: "h", y: -0.25 }, font: { color: "#1b1f24", size: 12 },
      paper_bgcolor: "#ffffff", plot_bgcolor: "#ffffff",
    };
  }

  function draw() {
    if (typeof Plotly === "undefined") return;
    for (const chart of config.charts) {
      const node = $(`chart-${chart.id}`);
      if (!node) continue;
      const data = traces(chart);
      const figure = node.closest("figure");
      const empty = data.length === 0;
      figure.classList.toggle("no-data", empty);
      figure.querySelector(".empty-note").hidden = !empty;
      if (empty && !node.data) continue;
      Plotly.react(node, data, layout(chart), { displaylogo: false, responsive: true,
        modeBarButtonsToRemove: ["select2d", "lasso2d"] });
      if (!node.dataset.linked) {
        node.dataset.linked = "1";
        node.on("plotly_relayout", (event) => linkZoom(node, event));
      }
    }
  }

  // Zooming one chart's steps zooms them all: curves are read side by side.
  function linkZoom(source, event) {
    if (syncing) return;
    let update = null;
    if (event["xaxis.autorange"]) update = { "xaxis.autorange": true };
    else if (event["xaxis.range[0]"] !== undefined) update = { "xaxis.range": [event["xaxis.range[0]"], event["xaxis.range[1]"]] };
    if (!update) return;
    syncing = true;
    const others = config.charts.map((c) => $(`chart-${c.id}`)).filter((n) => n && n !== source && n.data);
    Promise.all(others.map((n) => Plotly.relayout(n, update))).finally(() => { syncing = false; });
  }

  // --- the rest of the page ----------------------------------------------------------------

  function setText(field, text) {
    document.querySelectorAll(`[data-field="${field}"]`).forEach((node) => { node.textContent = text; });
  }

  function utc(ts) {
    if (!ts) return "—";
    return new Date(ts * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC");
  }

  function duration(seconds) {
    const s = Math.floor(seconds || 0), h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
    const pad = (n) => String(n).padStart(2, "0");
    return h ? `${h}h ${pad(m)}m` : m ? `${m}m ${pad(r)}s` : `${r}s`;
  }

  function updateHeader(job) {
    document.querySelectorAll('[data-field="status"]').forEach((node) => {
      node.textContent = job.status;
      node.className = `status status-${job.status}`;
    });
    setText("progress", job.step === null ? "—" : job.total_steps ? `${job.step} / ${job.total_steps}` : `${job.step}`);
    for (const headline of config.headlines) setText(headline.field, fmt(job[headline.field]));
    setText("finished_at", utc(job.finished_at));
    setText("duration", duration(job.duration_s));
    setText("trained_tokens", job.trained_tokens ? String(job.trained_tokens) : "—");
    setText("fine_tuned_model", job.fine_tuned_model || "—");
    for (const action of ["pause", "resume", "cancel"]) {
      const button = $(`action-${action}`);
      if (!button) continue;
      const allowed = job.actions.includes(action);
      button.disabled = !allowed;
      if (allowed) button.removeAttribute("aria-disabled"); else button.setAttribute("aria-disabled", "true");
    }
    const box = $("job-error");
    if (box) {
      box.hidden = !job.error;
      if (job.error) { setText("error-code", job.error.code || ""); setText("error-message", job.error.message || ""); }
    }
  }

  function updateEvents(events) {
    const list = $("events-list");
    if (!list) return;
    const items = events.map((e) => {
      const li = document.createElement("li");
      li.className = `event level-${e.level} type-${e.type}`;
      li.dataset.type = e.type;
      const time = document.createElement("time");
      time.dateTime = new Date(e.created_at * 1000).toISOString();
      time.textContent = utc(e.created_at);
      const level = document.createElement("span");
      level.className = "level";
      level.textContent = e.level;
      const message = document.createElement("span");
      message.className = "message";
      message.textContent = e.message;
      li.append(time, " ", level, " ", message);
      return li;
    });
    list.replaceChildren(...items);
  }

  function updateCheckpoints(checkpoints) {
    const body = document.querySelector("#checkpoints-table tbody");
    if (!body) return;
    if (!checkpoints.length) return;
    body.replaceChildren(...checkpoints.map((c) => {
      const tr = document.createElement("tr");
      const cells = [String(c.step), c.model, ...config.headlines.map((h) => fmt(c[h.field])), utc(c.created_at)];
      cells.forEach((text, i) => {
        const td = document.createElement("td");
        if (i === 1) { const code = document.createElement("code"); code.textContent = text; td.append(code); }
        else td.textContent = text;
        if (i === 2 || i === 3) td.className = "num";
        tr.append(td);
      });
      return tr;
    }));
  }

  // --- polling -----------------------------------------------------------------------------

  async function refresh() {
    const status = $("charts-status");
    try {
      const response = await fetch(`${config.dataUrl}?after_step=${lastStep}`, {
        credentials: "same-origin", headers: { Accept: "application/json" } });
      if (response.status === 401) { window.location.assign(`/dashboard/login?next=${encodeURIComponent(location.pathname)}`); return; }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const data = await response.json();
      merge(data.series);
      draw();
      updateHeader(data.job);
      updateEvents(data.events);
      updateCheckpoints(data.checkpoints);
      active = data.job.active;
      const when = new Date().toLocaleTimeString();
      if (status) status.textContent = active
        ? `Live: updated ${when}, refreshing every ${config.pollMs / 1000} s.`
        : `Updated ${when}. The job is ${data.job.status}; no more updates.`;
      document.body.dataset.lastStep = String(lastStep);
      document.body.dataset.jobStatus = data.job.status;
    } catch (error) {
      if (status) status.textContent = `Could not update (${error.message}); retrying.`;
    }
    if (active) timer = setTimeout(refresh, config.pollMs);
  }

  // --- controls ----------------------------------------------------------------------------

  const smoothing = $("smoothing");
  if (smoothing) smoothing.addEventListener("input", () => { $("smoothing-value").textContent = smoothing.value; draw(); });
  const share = $("tool-mix-share");
  if (share) share.addEventListener("change", draw);
  const metricEvents = $("show-metric-events");
  const events = $("events-list");
  if (metricEvents && events) {
    events.classList.add("hide-metrics");
    metricEvents.addEventListener("change", () => events.classList.toggle("hide-metrics", !metricEvents.checked));
  }
  document.querySelectorAll('form.action-form[data-action="cancel"]').forEach((form) => {
    form.addEventListener("submit", (event) => {
      if (!window.confirm("Cancel this job? A cancelled job cannot be resumed.")) event.preventDefault();
    });
  });

  refresh();
  window.addEventListener("pagehide", () => { if (timer) clearTimeout(timer); });
})();
