// vbatch console: live fragments, confirmations, the upload form and the throughput chart. No dependencies.
"use strict";

const POLL_MS = 2000;
const csrfToken = () => document.querySelector('meta[name="csrf-token"]').content;
const fromScript = { "X-Requested-With": "vbatch-console" };

// Elements with data-poll are refreshed from their URL until a fragment says it is final.
function poll(element) {
  const tick = async () => {
    if (!document.hidden) {
      try {
        const response = await fetch(element.dataset.poll, { headers: fromScript, credentials: "same-origin" });
        if (response.ok) {
          element.innerHTML = await response.text();
        }
      } catch (_) { /* the service is restarting: try again next tick */ }
    }
    const panel = element.querySelector("[data-final]");
    if (panel && panel.dataset.final === "true") {
      document.dispatchEvent(new CustomEvent("vbatch:final"));
      return;
    }
    setTimeout(tick, POLL_MS);
  };
  const panel = element.querySelector("[data-final]");
  if (!(panel && panel.dataset.final === "true")) setTimeout(tick, POLL_MS);
}

// Forms with data-confirm ask first (cancel, delete); the forms themselves may arrive in a refreshed fragment.
document.addEventListener("submit", (event) => {
  const message = event.target.dataset && event.target.dataset.confirm;
  if (message && !window.confirm(message)) event.preventDefault();
});

function autosubmit(form) {
  form.querySelectorAll("select").forEach((select) => select.addEventListener("change", () => form.submit()));
}

function setupUpload(form) {
  const input = form.querySelector('input[type="file"]');
  const zone = document.getElementById("dropzone");
  ["dragenter", "dragover"].forEach((name) => zone.addEventListener(name, (event) => {
    event.preventDefault();
    zone.classList.add("over");
  }));
  ["dragleave", "drop"].forEach((name) => zone.addEventListener(name, () => zone.classList.remove("over")));
  zone.addEventListener("drop", (event) => {
    event.preventDefault();
    if (event.dataTransfer.files.length) input.files = event.dataTransfer.files;
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const endpoint = form.querySelector("#endpoint").value;
    const body = new FormData();
    body.append("purpose", "batch");
    body.append("file", input.files[0]);
    const error = document.getElementById("upload-error");
    error.hidden = true;
    const button = form.querySelector("button");
    button.disabled = true;
    try {
      const response = await fetch(`/console/uploads?endpoint=${encodeURIComponent(endpoint)}`, {
        method: "POST", body, credentials: "same-origin",
        headers: { ...fromScript, "X-CSRF-Token": csrfToken() },
      });
      const answer = await response.json();
      if (!response.ok) throw new Error(answer.error ? answer.error.message : response.statusText);
      showReport(answer, endpoint);
    } catch (failure) {
      error.textContent = `Upload refused: ${failure.message}`;
      error.hidden = false;
    } finally {
      button.disabled = false;
    }
  });
}

const unknown = "unknown";

function number(value, digits = 0) {
  return value === null || value === undefined ? unknown : value.toLocaleString("en-US", { maximumFractionDigits: digits });
}

function showEstimate(estimate) {
  const box = document.getElementById("estimate");
  box.hidden = !estimate;
  if (!estimate) return;
  const set = (id, text) => { document.getElementById(id).textContent = text; };
  set("estimate-prompt", number(estimate.prompt_tokens));
  // Where the history tells only a range (answers cut at a lower cap), the expected figure is its middle.
  const between = (low, high, digits = 0, unit = "") =>
    low === null || high === null || low === high ? "" : ` (${number(low, digits)} to ${number(high, digits)}${unit})`;
  const outputRange = between(estimate.expected_output_tokens_low, estimate.expected_output_tokens_high);
  set("estimate-output", `${number(estimate.expected_output_tokens)} expected${outputRange}, at most ${number(estimate.max_output_tokens)}`);
  const share = estimate.expected_cached_share;
  set("estimate-cached", share === null ? unknown : `${number(estimate.expected_cached_tokens)} (${(share * 100).toFixed(1)}%)`);
  set("estimate-eta", estimate.eta_seconds === null ? unknown
    : `${number(estimate.eta_seconds, 1)} s${between(estimate.eta_seconds_low, estimate.eta_seconds_high, 1, " s")}`);
  set("estimate-gpu", number(estimate.gpu_seconds, 1));
  set("estimate-cost", estimate.cost_usd === null ? "no price set (VBATCH_GPU_HOUR_PRICE)" : `$${number(estimate.cost_usd, 4)}`);
  const basis = estimate.basis;
  const rate = basis.rate === "measured"
    ? `From ${basis.history_batch_ids.length} earlier batch(es) of ${estimate.model} on ${estimate.endpoint}: ` +
      `${number(basis.tokens_per_second, 1)} ${basis.rate_unit.replace("_", " ")}/s.`
    : `Rate unknown: no earlier batch of ${estimate.model} on ${estimate.endpoint} has completed here.`;
  set("estimate-basis", basis.output_reason ? `${rate} Output is a range: ${basis.output_reason}` : rate);
}

function showReport(answer, endpoint) {
  document.getElementById("report").hidden = false;
  document.getElementById("input_file_id").value = answer.file.id;
  document.getElementById("create_endpoint").value = endpoint;
  const summary = document.getElementById("report-summary");
  const table = document.getElementById("problems");
  const rows = table.querySelector("tbody");
  rows.replaceChildren();
  showEstimate(answer.estimate);
  if (answer.error_count === 0) {
    summary.textContent = `${answer.file.filename} (${answer.file.id}): ${answer.total} requests, all valid.`;
    table.hidden = true;
    document.getElementById("create").textContent = "Create batch";
    return;
  }
  summary.textContent = `${answer.file.filename} (${answer.file.id}): ${answer.error_count} problem(s); ` +
    "a batch of it would fail validation.";
  for (const problem of answer.problems) {
    const row = rows.insertRow();
    for (const value of [problem.line ?? "-", problem.code, problem.message]) row.insertCell().textContent = value;
  }
  table.hidden = false;
  document.getElementById("create").textContent = "Create batch anyway";
}

// Two small line charts (requests/s, output tokens/s) from the progress extension's series; drawn once more when
// the panel turns final, since the ended batch's series is its whole run, and again at a new width, so that the
// labels keep their size on a phone instead of shrinking with a scaled picture.
function chart(container) {
  let shown = null;
  const panelFinal = () => {
    const panel = document.querySelector("#batch-panel [data-final]");
    return panel && panel.dataset.final === "true";
  };
  const refresh = async () => {
    try {
      const response = await fetch(container.dataset.progress, { headers: fromScript, credentials: "same-origin" });
      if (!response.ok) return;
      const progress = await response.json();
      if (progress.series.length) draw(container, (shown = progress.series));
    } catch (_) { /* next tick */ }
  };
  const loop = async () => {
    await refresh();
    if (!panelFinal()) setTimeout(loop, POLL_MS);
  };
  document.addEventListener("vbatch:final", refresh);
  window.addEventListener("resize", () => shown && draw(container, shown));
  loop();
}

function draw(container, series) {
  const width = Math.max(container.clientWidth, 280);
  const parts = [["requests/s", 1, "#1d4ed8"], ["output tokens/s", 2, "#047857"]].map(([label, column, colour]) =>
    line(series.map((point) => [point[0], point[column]]), label, colour, width));
  container.replaceChildren(...parts.flat());
}

// Tick arithmetic, pure: round steps go 1, 2, 5, 10, 20, 50 ... (and 0.1, 0.2, 0.5 ... below one).

// The smallest round step that covers `max` (above zero) in at most `intervals` steps: never fewer than
// intervals / 2.5 of them, since round steps grow at most 2.5 times each.
function roundStep(max, intervals) {
  for (let decade = 10 ** Math.floor(Math.log10(max / intervals)); ; decade *= 10) {
    for (const multiple of [1, 2, 5]) {
      const step = Number((multiple * decade).toPrecision(1));
      if (stepsToCover(max, step) <= intervals) return step;
    }
  }
}

// A relative tolerance, so that 0.3 / 0.1 counts as 3 steps and not 4.
const stepsToCover = (max, step) => Math.ceil(max / step - 1e-9);

// Time reads in whole seconds, minutes or hours, with the half-minute and the half-hour between.
const TIME_STEPS = [1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800, 3600];

function timeStep(seconds, intervals) {
  if (seconds <= intervals) return roundStep(seconds, intervals);
  const fits = TIME_STEPS.find((step) => stepsToCover(seconds, step) <= intervals);
  return fits ?? 3600 * roundStep(seconds / 3600, intervals);
}

// 0, step, 2 step ... up to the first at or past `max`: the axis ends on a round value and covers the whole series.
function ticksUpTo(max, step) {
  const count = Math.max(1, stepsToCover(max, step));
  return Array.from({ length: count + 1 }, (_, i) => Number((i * step).toPrecision(12)));
}

// 3 to 5 value ticks; a series of zeros still gets an axis (0 to 1).
function valueTicks(max) {
  const top = max > 0 ? max : 1;
  return ticksUpTo(top, roundStep(top, 4));
}

// 3 to 6 time ticks, in seconds into the run.
function timeTicks(seconds) {
  const span = seconds > 0 ? seconds : 1;
  return ticksUpTo(span, timeStep(span, 5));
}

// 1.2k, 3.4M: a value label short enough for a phone.
function compact(value) {
  const [divisor, suffix] = [[1e9, "G"], [1e6, "M"], [1e3, "k"]].find(([size]) => Math.abs(value) >= size) ?? [1, ""];
  return `${Number((value / divisor).toPrecision(3))}${suffix}`;
}

// Every time label of one axis in the unit its step is whole in: 0, 30 s, 60 s or 0, 2 min, 4 min.
function timeLabels(ticks) {
  const step = ticks[1] - ticks[0];
  const [size, unit] = step >= 3600 ? [3600, "h"] : step >= 60 ? [60, "min"] : [1, "s"];
  return ticks.map((tick) => (tick === 0 ? "0" : `${Number((tick / size).toPrecision(12))} ${unit}`));
}

const CHART_HEIGHT = 190;

// Room around the plot: the value axis title above it, value labels left of it, time labels and title below.
function frame(width, valueLabels) {
  const left = 12 + 7 * Math.max(...valueLabels.map((text) => text.length));
  return { left, right: width - 28, top: 26, bottom: CHART_HEIGHT - 40 };
}

const round1 = (pixels) => Math.round(pixels * 10) / 10;

// Light grid lines at every tick, the two axes, their labels and titles; `x` and `y` place a point on the plot.
function axes(box, xTicks, yTicks, title) {
  const x = (seconds) => round1(box.left + (seconds / xTicks[xTicks.length - 1]) * (box.right - box.left));
  const y = (value) => round1(box.bottom - (value / yTicks[yTicks.length - 1]) * (box.bottom - box.top));
  const xLabels = timeLabels(xTicks);
  const grid = yTicks.map((v) => `<line x1="${box.left}" x2="${box.right}" y1="${y(v)}" y2="${y(v)}"/>`)
    .concat(xTicks.map((s) => `<line x1="${x(s)}" x2="${x(s)}" y1="${box.top}" y2="${box.bottom}"/>`));
  const yText = yTicks.map((v) => `<text x="${box.left - 6}" y="${y(v) + 4}">${compact(v)}</text>`);
  const xText = xTicks.map((s, i) => `<text x="${x(s)}" y="${box.bottom + 16}">${xLabels[i]}</text>`);
  const plot = `<rect class="plot" x="${box.left}" y="${box.top}" width="${box.right - box.left}" ` +
    `height="${box.bottom - box.top}"/>`;
  const markup = `${plot}<g class="grid">${grid.join("")}</g>` +
    `<path class="axis" d="M${box.left},${box.top}V${box.bottom}H${box.right}"/>` +
    `<g class="y-ticks">${yText.join("")}</g><g class="x-ticks">${xText.join("")}</g>` +
    `<text class="axis-title y-title" x="${box.left}" y="${box.top - 10}">${title}</text>` +
    `<text class="axis-title x-title" x="${(box.left + box.right) / 2}" y="${box.bottom + 34}">time into the run</text>`;
  return { x, y, markup };
}

// Each point is the rate over the step that ends at it: drawn as a step, so that one point is a line too.
function stepLine(points, x, y) {
  const coords = [];
  let start = 0;
  for (const [end, rate] of points) {
    coords.push(`${x(start)},${y(rate)}`, `${x(end)},${y(rate)}`);
    start = end;
  }
  return coords.join(" ");
}

function line(points, label, colour, width) {
  const maxX = Math.max(...points.map((p) => p[0]));
  const maxY = Math.max(...points.map((p) => p[1]));
  const xTicks = timeTicks(maxX), yTicks = valueTicks(maxY);
  const { x, y, markup } = axes(frame(width, yTicks.map(compact)), xTicks, yTicks, label);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${CHART_HEIGHT}`);
  svg.setAttribute("role", "img");
  const last = points[points.length - 1][1];
  const seconds = maxX.toFixed(1);
  svg.setAttribute("aria-label", `${label}: last ${last}, highest ${maxY}, over ${seconds} s`);
  svg.innerHTML = markup +
    `<polyline class="rate" fill="none" stroke="${colour}" stroke-width="2" points="${stepLine(points, x, y)}"/>`;
  const legend = document.createElement("p");
  legend.className = "chart-legend";
  legend.textContent = `${label}: last ${last.toLocaleString()}, highest ${maxY.toLocaleString()} ` +
    `(${seconds} s of the run)`;
  const wrap = document.createElement("div");
  wrap.className = "chart";
  wrap.append(svg);
  return [wrap, legend];
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-poll]").forEach(poll);
  document.querySelectorAll("form[data-autosubmit]").forEach(autosubmit);
  const upload = document.getElementById("upload-form");
  if (upload) setupUpload(upload);
  const container = document.getElementById("chart");
  if (container) chart(container);
});
