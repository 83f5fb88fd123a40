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
  set("estimate-output", `${number(estimate.expected_output_tokens)} expected, at most ${number(estimate.max_output_tokens)}`);
  const share = estimate.expected_cached_share;
  set("estimate-cached", share === null ? unknown : `${number(estimate.expected_cached_tokens)} (${(share * 100).toFixed(1)}%)`);
  set("estimate-eta", estimate.eta_seconds === null ? unknown : `${number(estimate.eta_seconds, 1)} s`);
  set("estimate-gpu", number(estimate.gpu_seconds, 1));
  set("estimate-cost", estimate.cost_usd === null ? "no price set (VBATCH_GPU_HOUR_PRICE)" : `$${number(estimate.cost_usd, 4)}`);
  const basis = estimate.basis;
  set("estimate-basis", basis.rate === "measured"
    ? `From ${basis.history_batch_ids.length} earlier batch(es) of ${estimate.model} on ${estimate.endpoint}: ` +
      `${number(basis.tokens_per_second, 1)} ${basis.rate_unit.replace("_", " ")}/s.`
    : `Rate unknown: no earlier batch of ${estimate.model} on ${estimate.endpoint} has completed here.`);
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
// the panel turns final, since the ended batch's series is its whole run.
function chart(container) {
  const panelFinal = () => {
    const panel = document.querySelector("#batch-panel [data-final]");
    return panel && panel.dataset.final === "true";
  };
  const refresh = async () => {
    try {
      const response = await fetch(container.dataset.progress, { headers: fromScript, credentials: "same-origin" });
      if (!response.ok) return;
      const progress = await response.json();
      if (progress.series.length) draw(container, progress.series);
    } catch (_) { /* next tick */ }
  };
  const loop = async () => {
    await refresh();
    if (!panelFinal()) setTimeout(loop, POLL_MS);
  };
  document.addEventListener("vbatch:final", refresh);
  loop();
}

function draw(container, series) {
  const parts = [["requests/s", 1, "#1d4ed8"], ["output tokens/s", 2, "#047857"]].map(([label, column, colour]) =>
    line(series.map((point) => [point[0], point[column]]), label, colour));
  container.replaceChildren(...parts.flat());
}

// Each point is the rate over the step that ends at it: drawn as a step, so that one point is a line too.
function line(points, label, colour) {
  const width = 640, height = 140, pad = 6;
  const maxX = Math.max(...points.map((p) => p[0]), 1e-9);
  const maxY = Math.max(...points.map((p) => p[1]), 1e-9);
  const at = (x, y) =>
    `${(pad + (x / maxX) * (width - 2 * pad)).toFixed(1)},${(height - pad - (y / maxY) * (height - 2 * pad)).toFixed(1)}`;
  const coords = [];
  let start = 0;
  for (const [x, y] of points) {
    coords.push(at(start, y), at(x, y));
    start = x;
  }
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("role", "img");
  const last = points[points.length - 1][1];
  const seconds = maxX.toFixed(1);
  svg.setAttribute("aria-label", `${label}: last ${last}, highest ${maxY}, over ${seconds} s`);
  svg.innerHTML = `<rect x="0" y="0" width="${width}" height="${height}" fill="#f8fafc" stroke="#d4d8e0"/>` +
    `<polyline fill="none" stroke="${colour}" stroke-width="2" points="${coords.join(" ")}"/>`;
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
