// Tandem sampler dashboard: polls GET status and GET dashboard/data and redraws.
//
// No dependencies and no build step (the sampler may run offline). Charts are drawn on
// <canvas> by the small functions below; each chart canvas carries `data-points`, the
// number of data points it plotted, so tests and curious humans can check it.
// Model output and prompts are untrusted: they only ever reach the page through
// textContent, never innerHTML.
"use strict";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
// ?interval=ms sets the refresh period (default 2 s, at least 100 ms).
const INTERVAL = Math.max(100, Number(params.get("interval")) || 2000);
const COLORS = {
  gen: "#4e9bff", train: "#ff9f43", reward: "#3ecf8e", eval: "#b48cff", grid: "#2a323c",
  text: "#8a96a3", bar: "#4e9bff", line: "#4e9bff", bad: "#ff5d5d",
};
// The trainer's off-policy correction metrics (docs/corrections.md), one line each. Trainers
// older than issue 29 send none of them: the charts then say so instead of drawing.
const MISMATCH_SERIES = [
  { key: "mismatch_k3", name: "k3", color: COLORS.train },
  { key: "mismatch_k1", name: "k1", color: COLORS.gen },
  // Only in batches that mix staleness values (absent keys draw nothing).
  { key: "mismatch_k3_stale0", name: "k3 stale 0", color: COLORS.reward },
  { key: "mismatch_k3_stale1", name: "k3 stale 1", color: COLORS.eval },
  { key: "mismatch_k3_stale2plus", name: "k3 stale 2+", color: COLORS.bad },
];
const CORRECTION_SERIES = [
  { key: "is_masked_fraction", name: "tokens masked", color: COLORS.train },
  { key: "rejected_fraction", name: "sequences rejected", color: COLORS.bad },
  { key: "is_truncated_fraction", name: "weights truncated", color: COLORS.gen },
];

let latest = null; // last dashboard/data answer, for re-filtering rollouts without a fetch

// --- formatting -------------------------------------------------------------------------

function fmt(value, digits = 2) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  if (Math.abs(value) >= 1000) return value.toFixed(0);
  return value.toFixed(digits);
}

function setText(id, value, digits) { $(id).textContent = fmt(value, digits); }

function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  if (seconds < 1) return (seconds * 1000).toFixed(0) + " ms";
  if (seconds < 120) return seconds.toFixed(1) + " s";
  return (seconds / 60).toFixed(1) + " min";
}

// --- canvas helpers ---------------------------------------------------------------------

function prepare(canvas) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 400;
  const h = canvas.clientHeight || 200;
  if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
    canvas.width = Math.round(w * dpr);
    canvas.height = Math.round(h * dpr);
  }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h };
}

function ticks(min, max, count) {
  if (!(max > min)) { max = min + 1; }
  const raw = (max - min) / count;
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= raw) || raw;
  const out = [];
  for (let v = Math.ceil(min / step) * step; v <= max + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

// Decimals that tell evenly spaced ticks apart: 2 as before, more for small steps (mismatch
// metrics live around 1e-3, where two decimals would label 0.005 and 0.010 both "0.01").
function tickDigits(values) {
  if (values.length < 2) return 2;
  const step = values[1] - values[0];
  let digits = Math.max(0, Math.ceil(-Math.log10(step) - 1e-9));
  const scaled = step * Math.pow(10, digits);
  if (Math.abs(scaled - Math.round(scaled)) > 1e-6) digits += 1; // steps of 2.5 x 10^k
  return Math.min(Math.max(2, digits), 12);
}

function emptyChart(canvas, message) {
  const { ctx, w, h } = prepare(canvas);
  ctx.fillStyle = COLORS.text;
  ctx.textAlign = "center";
  ctx.fillText(message || "no data yet", w / 2, h / 2);
  canvas.dataset.points = "0";
}

function frame(ctx, w, h, xr, yr, opts) {
  const pad = { l: 48, r: 12, t: 18, b: 26 };
  const X = (x) => pad.l + (xr[1] === xr[0] ? 0.5 : (x - xr[0]) / (xr[1] - xr[0])) * (w - pad.l - pad.r);
  const Y = (y) => h - pad.b - (yr[1] === yr[0] ? 0.5 : (y - yr[0]) / (yr[1] - yr[0])) * (h - pad.t - pad.b);
  ctx.strokeStyle = COLORS.grid;
  ctx.fillStyle = COLORS.text;
  ctx.lineWidth = 1;
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  const yticks = ticks(yr[0], yr[1], 4);
  const ydigits = tickDigits(yticks);
  for (const v of yticks) {
    const y = Y(v);
    ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
    ctx.fillText(fmt(v, ydigits), pad.l - 6, y);
  }
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  const xfmt = opts.xfmt || fmt;
  for (const v of ticks(xr[0], xr[1], Math.max(2, Math.floor((w - pad.l) / 80)))) {
    if (opts.integerX && !Number.isInteger(v)) continue;
    ctx.fillText(xfmt(v), X(v), h - pad.b + 6);
  }
  if (opts.xlabel) { ctx.textAlign = "right"; ctx.fillText(opts.xlabel, w - pad.r, h - 12); }
  return { X, Y, pad };
}

function legend(ctx, w, items) {
  ctx.textBaseline = "middle";
  ctx.textAlign = "left";
  let x = w - 12;
  for (const item of [...items].reverse()) {
    const width = ctx.measureText(item.name).width;
    x -= width;
    ctx.fillStyle = COLORS.text;
    ctx.fillText(item.name, x, 8);
    x -= 14;
    ctx.fillStyle = item.color;
    ctx.fillRect(x, 4, 10, 8);
    x -= 12;
  }
}

// series: [{name, color, points: [[x, y], ...]}]
function lineChart(canvas, series, opts = {}) {
  const all = series.flatMap((s) => s.points);
  if (!all.length) { emptyChart(canvas); return; }
  const { ctx, w, h } = prepare(canvas);
  const xs = all.map((p) => p[0]);
  const ys = all.map((p) => p[1]);
  let ymin = Math.min(...ys), ymax = Math.max(...ys);
  if (opts.zeroBased) ymin = Math.min(0, ymin);
  if (ymax === ymin) { ymax += 0.5; ymin -= opts.zeroBased && ymin === 0 ? 0 : 0.5; }
  const span = ymax - ymin;
  const { X, Y } = frame(ctx, w, h, [Math.min(...xs), Math.max(...xs)], [ymin, ymax + span * 0.05], opts);
  for (const s of series) {
    if (!s.points.length) continue;
    ctx.strokeStyle = s.color;
    ctx.fillStyle = s.color;
    ctx.lineWidth = 2;
    ctx.beginPath();
    s.points.forEach(([x, y], i) => (i ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
    ctx.stroke();
    if (s.points.length < 60 || s.dots) {
      for (const [x, y] of s.points) { ctx.beginPath(); ctx.arc(X(x), Y(y), 2.5, 0, 2 * Math.PI); ctx.fill(); }
    }
  }
  legend(ctx, w, series);
  canvas.dataset.points = String(all.length);
}

// bars: [{label, value}]
function barChart(canvas, bars, opts = {}) {
  if (!bars.length) { emptyChart(canvas); return; }
  const { ctx, w, h } = prepare(canvas);
  const max = Math.max(...bars.map((b) => b.value), 1);
  const { Y, pad } = frame(ctx, w, h, [0, 1], [0, max * 1.08], { xfmt: () => "" });
  const slot = (w - pad.l - pad.r) / bars.length;
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  bars.forEach((b, i) => {
    const x = pad.l + i * slot + slot * 0.15;
    ctx.fillStyle = opts.color || COLORS.bar;
    ctx.fillRect(x, Y(b.value), slot * 0.7, Y(0) - Y(b.value));
    ctx.fillStyle = COLORS.text;
    ctx.fillText(b.label, pad.l + (i + 0.5) * slot, h - pad.b + 6);
  });
  if (opts.xlabel) { ctx.textAlign = "right"; ctx.fillText(opts.xlabel, w - pad.r, h - 12); }
  canvas.dataset.points = String(bars.length);
}

// rows: [{step, gen_start, gen_end, train_start, train_end, publish?}] (unix seconds); one lane
// per step, generation in the upper half, training in the lower half, so overlap reads
// vertically. `publish` ({snapshot, write, apply}: [start, end]) is version step+1's way out,
// drawn as a thin strip under the training bar: the snapshot on the trainer's critical path,
// the write and the servers' apply in the background while the next step trains.
const PUBLISH_PARTS = [["snapshot", "#ff5d5d"], ["write", "#b48cff"], ["apply", "#3ecf8e"]];

function timelineChart(canvas, rows, now) {
  rows = rows.filter((r) => r.gen_start != null).slice(-16);
  if (!rows.length) { emptyChart(canvas); return; }
  const { ctx, w, h } = prepare(canvas);
  const t0 = Math.min(...rows.map((r) => r.gen_start));
  const t1 = Math.max(now, ...rows.map((r) => r.train_end || r.gen_end || now));
  const pad = { l: 56, r: 12, t: 20, b: 26 };
  const X = (t) => pad.l + ((t - t0) / Math.max(t1 - t0, 1e-3)) * (w - pad.l - pad.r);
  const lane = (h - pad.t - pad.b) / rows.length;
  ctx.strokeStyle = COLORS.grid;
  ctx.fillStyle = COLORS.text;
  ctx.textAlign = "center";
  ctx.textBaseline = "top";
  for (const v of ticks(0, t1 - t0, Math.max(2, Math.floor((w - pad.l) / 90)))) {
    const x = X(t0 + v);
    ctx.beginPath(); ctx.moveTo(x, pad.t); ctx.lineTo(x, h - pad.b); ctx.stroke();
    ctx.fillText(duration(v), x, h - pad.b + 6);
  }
  let points = 0;
  rows.forEach((r, i) => {
    const y = pad.t + i * lane;
    ctx.fillStyle = COLORS.text;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    ctx.fillText("step " + r.step, pad.l - 6, y + lane / 2);
    const barH = Math.max(2, lane / 2 - 2);
    const gx = X(r.gen_start), gw = Math.max(2, X(r.gen_end || now) - gx);
    ctx.fillStyle = COLORS.gen;
    ctx.fillRect(gx, y + 1, gw, barH);
    points += 1;
    if (r.train_start != null) {
      const tx = X(r.train_start), tw = Math.max(2, X(r.train_end || now) - tx);
      ctx.fillStyle = COLORS.train;
      ctx.globalAlpha = r.train_end ? 1 : 0.5; // still training: drawn up to now, faded
      ctx.fillRect(tx, y + lane / 2, tw, barH);
      ctx.globalAlpha = 1;
      points += 1;
    }
    const strip = Math.max(1, barH / 3);
    for (const [part, color] of PUBLISH_PARTS) {
      const span = r.publish && r.publish[part];
      if (!span) continue;
      const px = X(span[0]), pw = Math.max(2, X(span[1]) - px);
      ctx.fillStyle = color;
      ctx.fillRect(px, y + lane / 2 + barH - strip, pw, strip);
      points += 1;
    }
  });
  legend(ctx, w, [{ name: "generation", color: COLORS.gen }, { name: "training", color: COLORS.train },
    ...PUBLISH_PARTS.map(([part, color]) => ({ name: part, color }))]);
  canvas.dataset.points = String(points);
}

// The trainer's metrics list (one record per version, step = version - 1) as lines, one per
// spec {key, name, color}; a record without a key, or with a non-number there, draws nothing
// for it, so metrics that an older trainer does not send never break the page.
function trainerChart(canvas, records, specs, emptyMessage) {
  const series = specs.map((s) => ({ name: s.name, color: s.color,
    points: records.filter((m) => Number.isFinite(m[s.key])).map((m) => [m.version - 1, m[s.key]]) }))
    .filter((s) => s.points.length);
  if (!series.length) { emptyChart(canvas, emptyMessage || undefined); return; }
  lineChart(canvas, series, { integerX: true, zeroBased: true, xlabel: "step" });
}

// --- tables -------------------------------------------------------------------------------

function cell(row, text, cls) {
  const td = document.createElement("td");
  td.textContent = text; // never innerHTML: prompts and completions are untrusted
  if (cls) td.className = cls;
  row.appendChild(td);
  return td;
}

// A server in rotation gets work; every other state says why it does not (see /status).
const STATE_CLASS = { ok: "healthy", joining: "muted", leaving: "muted", syncing: "muted" };

function renderServers(servers) {
  const body = $("servers").tBodies[0];
  body.replaceChildren();
  const events = [];
  for (const s of servers) {
    const tr = document.createElement("tr");
    tr.dataset.url = s.url;
    tr.dataset.state = s.state;
    cell(tr, s.url, "text");
    cell(tr, fmt(s.version), "num");
    const state = s.syncing && s.state === "ok" ? "syncing" : (s.state || (s.healthy ? "ok" : "failing"));
    cell(tr, state, STATE_CLASS[state] || "unhealthy");
    cell(tr, fmt(s.outstanding), "num");
    cell(tr, fmt(s.requests), "num");
    cell(tr, fmt(s.failures), "num");
    cell(tr, fmt(s.resyncs), "num");
    cell(tr, duration(s.last_sync_seconds), "num");
    const probe = s.probe;
    const probeText = !probe ? "–" : probe.error ? "failed"
      : `${probe.max_abs_diff.toExponential(1)} / ${probe.max_tolerance}`;
    cell(tr, probeText, probe ? (probe.ok ? "num healthy" : "num unhealthy") : "num");
    cell(tr, s.reason || s.error || "", "text");
    body.appendChild(tr);
    for (const e of s.events || []) events.push({ at: e.at, url: s.url, event: e.event });
  }
  events.sort((a, b) => b.at - a.at);
  const eventsBody = $("server-events").tBodies[0];
  eventsBody.replaceChildren();
  for (const e of events.slice(0, 20)) {
    const tr = document.createElement("tr");
    cell(tr, new Date(e.at * 1000).toLocaleTimeString(), "num");
    cell(tr, e.url, "text");
    cell(tr, e.event, "text");
    eventsBody.appendChild(tr);
  }
}

function renderRollouts() {
  if (!latest) return;
  const text = $("filter-text").value.trim().toLowerCase();
  const minReward = $("filter-reward").value === "" ? null : Number($("filter-reward").value);
  const step = $("filter-step").value === "" ? null : Number($("filter-step").value);
  const rows = latest.rollouts.filter((r) =>
    (!text || [r.prompt, r.completion, r.prompt_id].some((t) => (t || "").toLowerCase().includes(text))) &&
    (minReward === null || r.reward >= minReward) &&
    (step === null || r.step === step));
  const body = $("rollouts").tBodies[0];
  body.replaceChildren();
  for (const r of rows) {
    const tr = document.createElement("tr");
    cell(tr, String(r.step), "num");
    cell(tr, String(r.policy_version), "num");
    cell(tr, fmt(r.reward, 3), "num").title = Object.entries(r.rewards || {}).map(([k, v]) => `${k}: ${fmt(v, 3)}`).join("\n");
    cell(tr, r.finish_reason || "");
    cell(tr, r.prompt, "text prompt").title = r.prompt_id;
    cell(tr, r.completion, "text completion");
    body.appendChild(tr);
  }
  $("rollout-count").textContent = `${rows.length} of ${latest.rollouts.length}`;
}

// --- rendering ----------------------------------------------------------------------------

function renderStatus(st) {
  const c = st.config;
  $("run").textContent = `namespace ${c.namespace} · env ${c.env} · ${c.strategy} · ` +
    `${c.prompts_per_step}×${c.num_generations} per step · up ${duration(st.uptime_seconds)}`;
  setText("next-step", st.steps.next_step);
  setText("last-sealed", st.steps.last_sealed_step);
  setText("published", st.versions.published);
  setText("min-served", st.versions.min_served);
  setText("ready", st.queues.batches_ready);
  setText("in-progress", st.queues.batches_in_progress);
  setText("in-flight", st.queues.in_flight_requests);
  setText("retries", st.throughput.retries);
  setText("errors", st.throughput.errors);
  setText("staleness", st.staleness.recent_mean);
  setText("k", c.max_staleness);
  const t = st.throughput;
  setText("cps", t.recent_completions_per_second ?? t.completions_per_second, 1);
  setText("tps", t.recent_tokens_per_second ?? t.tokens_per_second, 0);
  setText("reward", st.rewards ? st.rewards.last_batch_mean : null, 3);
  setText("eval-reward", st.rewards && st.rewards.last_eval ? st.rewards.last_eval.reward_mean : null, 3);
  const envs = Object.values(st.environments || {});
  const total = (key) => envs.reduce((sum, e) => sum + (e[key] || 0), 0);
  setText("env-turns", total("turns"), 0);
  setText("env-tools", total("tool_calls"), 0);
  setText("env-tool-errors", total("tool_errors") + total("tool_timeouts"), 0);
  setText("env-retries", total("trajectory_retries"), 0);
  setText("env-dropped", total("groups_dropped"), 0);
  setText("env-forks", total("forks"), 0);
  renderServers(st.inference_servers);
  const problems = [st.steps.last_error, ...st.steps.in_progress.map((p) => p.error)].filter(Boolean);
  if (st.rollout_log && st.rollout_log.last_error) problems.push("rollout log: " + st.rollout_log.last_error);
  for (const [name, e] of Object.entries(st.environments || {})) {
    if (e.groups_dropped && e.last_error) problems.push(`environment ${name}: ${e.groups_dropped} group(s) dropped; last error: ${e.last_error}`);
  }
  $("error").hidden = !problems.length;
  $("error").textContent = [...new Set(problems)].join("\n");
}

function renderData(d) {
  latest = d;
  const evals = d.evals.filter((e) => e.status === "done" && e.reward_mean != null);
  lineChart($("chart-reward"), [
    { name: "batch reward", color: COLORS.reward, points: d.batches.map((b) => [b.step, b.reward_mean]) },
    { name: "eval reward (by version)", color: COLORS.eval, dots: true,
      points: evals.map((e) => [e.policy_version, e.reward_mean]).sort((a, b) => a[0] - b[0]) },
  ], { integerX: true, xlabel: "step" });
  barChart($("chart-staleness"), Object.entries(d.staleness_histogram).map(([k, v]) => ({ label: k, value: v })),
    { xlabel: "staleness (samples)" });
  timelineChart($("chart-timeline"), d.timeline, d.now);
  // Step N's metrics arrive with version N + 1. Near 0 when inference serves the trainer's
  // weights; nats when it does not (stale weights), whatever HTTP said.
  const trainer = d.trainer || [];
  trainerChart($("chart-mismatch"), trainer, [{ key: "behaviour_mismatch", name: "behaviour_mismatch", color: COLORS.train }],
    "no trainer metrics yet (the trainer sends them with each version)");
  // KL(mu || pi_old) estimates and what the correction dropped (docs/corrections.md).
  const older = trainer.length ? "no correction metrics (a trainer from before these metrics)" : null;
  trainerChart($("chart-offpolicy"), trainer, MISMATCH_SERIES, older);
  trainerChart($("chart-correction"), trainer, CORRECTION_SERIES, older);
  const ago = (t) => t - d.now;
  lineChart($("chart-cps"), [{ name: "completions/s", color: COLORS.gen,
    points: d.throughput.map((p) => [ago(p.t), p.completions_per_second]) }],
    { zeroBased: true, xlabel: "seconds ago", xfmt: (v) => fmt(-v, 0) });
  lineChart($("chart-tps"), [{ name: "tokens/s", color: COLORS.train,
    points: d.throughput.map((p) => [ago(p.t), p.tokens_per_second]) }],
    { zeroBased: true, xlabel: "seconds ago", xfmt: (v) => fmt(-v, 0) });
  renderRollouts();
}

// A 401 means this browser's token is no longer the run's (the sampler restarted with a new
// one, or the cookie is gone): reload, so the sampler's page says how to get in instead of this
// page showing "disconnected" forever. Not again within a minute unless a poll succeeded in
// between, in case something keeps answering 401 to the polls while still serving the page.
const RELOAD_KEY = "tandem-dashboard-reloaded-at";

function reloadForToken() {
  const last = Number(sessionStorage.getItem(RELOAD_KEY) || 0);
  if (Date.now() - last < 60000) return;
  sessionStorage.setItem(RELOAD_KEY, String(Date.now()));
  location.reload();
}

async function fetchJSON(path) {
  const response = await fetch(path, { cache: "no-store" });
  if (response.status === 401) reloadForToken();
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

async function tick() {
  try {
    const [status, data] = await Promise.all([fetchJSON("status"), fetchJSON("dashboard/data")]);
    renderStatus(status);
    renderData(data);
    $("conn").textContent = "live";
    sessionStorage.removeItem(RELOAD_KEY);
    $("conn").className = "conn ok";
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (err) {
    // A restarting sampler is normal: say so in the page and keep polling.
    $("conn").textContent = "disconnected";
    $("conn").className = "conn down";
    $("conn").title = String(err);
  } finally {
    setTimeout(tick, INTERVAL);
  }
}

for (const id of ["filter-text", "filter-reward", "filter-step"]) $(id).addEventListener("input", renderRollouts);
window.addEventListener("resize", () => latest && renderData(latest));
tick();
