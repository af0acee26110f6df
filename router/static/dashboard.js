// pdserve operators' dashboard: polls the router's status API and draws it with uPlot.
// Data: GET /v1/cluster/status, /v1/cluster/history, /v1/requests (every POLL_MS), and
// /v1/requests/{id} when a request is clicked. With --api-key, the key is asked once, kept in
// sessionStorage and sent as "Authorization: Bearer <key>"; a 401 asks again.
"use strict";

const POLL_MS = 2000;
const KEY_NAME = "pdserve-api-key";
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#db2777",
                "#65a30d", "#4f46e5", "#b45309"];

const $ = (sel) => document.querySelector(sel);
const charts = {};
let waitingForKey = false;

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k === "style") e.style.cssText = v;
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(c ?? ""));
  return e;
}

function fmt(v, digits = 1) {
  if (v === null || v === undefined) return "–";
  if (typeof v !== "number") return String(v);
  return Number.isInteger(v) ? v.toLocaleString() : v.toFixed(digits);
}

function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

class Unauthorized extends Error {}

async function api(path) {
  const headers = {};
  const key = sessionStorage.getItem(KEY_NAME);
  if (key) headers.Authorization = `Bearer ${key}`;
  const r = await fetch(path, { headers, cache: "no-store" });
  if (r.status === 401) throw new Unauthorized("the API key is missing or wrong");
  if (!r.ok) throw new Error(`${path}: HTTP ${r.status}`);
  return r.json();
}

function askForKey() {
  waitingForKey = true;
  $("#key-form").hidden = false;
  $("#key-input").focus();
}

$("#key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_NAME, $("#key-input").value);
  $("#key-input").value = "";
  $("#key-form").hidden = true;
  waitingForKey = false;
  refresh();
});

// -- banner ------------------------------------------------------------------------------------

function banner(messages) {
  const b = $("#banner");
  b.replaceChildren(...messages.map((m) => el("div", {}, m)));
  b.hidden = messages.length === 0;
}

// -- header, cards, tables ------------------------------------------------------------------------

function renderHeader(s) {
  $("#model").textContent = `${s.model} · max_model_len ${s.max_model_len}`;
  $("#mode").textContent = s.mode;
  const a = s.admission;
  const adm = $("#admission");
  adm.textContent = `admission ${a.state}`;
  adm.className = `badge ${a.state}`;
  $("#updated").textContent = `updated ${new Date(s.time * 1000).toLocaleTimeString()}`;
}

function renderCards(s) {
  const r = s.requests, l = s.latency, t = s.throughput;
  const items = [
    ["running", r.running], ["waiting", r.waiting], ["requests", r.total],
    ["finished", Object.values(r.finished).reduce((x, y) => x + y, 0)],
    ["aborted", r.aborted], ["rejected (429)", r.rejected],
    ["client disconnects", r.client_disconnects],
    ["preempted / migrated", `${r.preemptions} / ${r.migrations}`],
    ["output tokens/s (1m)", t.output_tokens_per_s["1m"]],
    ["TTFT p50 / p99 ms (1m)", `${fmt(l.ttft_ms["1m"].p50)} / ${fmt(l.ttft_ms["1m"].p99)}`],
    ["TPOT p50 / p99 ms (1m)", `${fmt(l.tpot_ms["1m"].p50)} / ${fmt(l.tpot_ms["1m"].p99)}`],
    ["KV transferred", bytes(s.kv_transfers.bytes)],
  ];
  $("#cards").replaceChildren(...items.map(([k, v]) =>
    el("div", { class: "card" }, el("div", { class: "v" }, fmt(v)), el("div", { class: "k" }, k))));
}

function kvBar(w) {
  const pct = Math.round(100 * (w.kv_usage || 0));
  const bar = el("span", { class: `bar${pct >= 90 ? " hot" : ""}` },
                 el("span", { style: `width:${pct}%` }));
  return el("td", { title: `${w.kv_blocks_used} / ${w.kv_blocks_total} blocks` }, bar, `${pct}%`);
}

function renderWorkers(s) {
  const rows = s.workers.map((w) => el("tr", { "data-worker": w.id },
    el("td", {}, w.id), el("td", {}, w.role), el("td", {}, w.node ?? "–"),
    el("td", { class: `health-${w.health}` }, w.health), el("td", {}, fmt(w.restarts)),
    kvBar(w), el("td", {}, fmt(w.running)), el("td", {}, fmt(w.waiting)),
    el("td", {}, fmt(w.batch_size, 2)), el("td", {}, fmt(w.step_time_ms)),
    el("td", {}, fmt(w.tokens_per_s)), el("td", {}, fmt(w.tokens_per_s_1m)),
    el("td", {}, w.prefix_cache_hit_rate == null ? "–" : `${(100 * w.prefix_cache_hit_rate).toFixed(1)}%`),
    el("td", {}, bytes(w.kv_bytes_sent)), el("td", {}, bytes(w.kv_bytes_received))));
  $("#workers tbody").replaceChildren(...rows);
}

function renderAdmission(s) {
  const a = s.admission;
  const rows = [
    ["state", a.state],
    ["queued requests", `${a.queued_requests} / ${a.max_queued_requests}`],
    ["queued prompt tokens", `${fmt(a.queued_tokens)} / ${fmt(a.max_queued_tokens)}`],
    ["rejected (429)", a.rejected], ["Retry-After (s)", a.retry_after_s],
  ];
  $("#admission-table tbody").replaceChildren(...rows.map(([k, v]) =>
    el("tr", {}, el("td", {}, k), el("td", {}, fmt(v)))));
  const lat = s.latency;
  $("#latency-table tbody").replaceChildren(...["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"].map((k) =>
    el("tr", {}, el("td", {}, k.replace("_ms", "").toUpperCase() + " ms"),
      el("td", {}, fmt(lat[k]["1m"].p50)), el("td", {}, fmt(lat[k]["1m"].p99)),
      el("td", {}, fmt(lat[k]["5m"].p50)), el("td", {}, fmt(lat[k]["5m"].p99)),
      el("td", {}, fmt(lat[k]["5m"].count)))));
}

function phaseBar(p) {
  if (!p) return "–";
  const parts = [["queue", p.queue], ["prefill", p.prefill], ["decode", p.decode]];
  const total = parts.reduce((x, [, v]) => x + (v || 0), 0);
  const bar = el("span", { class: "phases" }, ...parts.map(([k, v]) =>
    el("span", { class: `ph-${k}`, style: `width:${total ? (100 * (v || 0)) / total : 0}%` })));
  const text = parts.map(([, v]) => fmt(v, 0)).join(" · ");
  return el("span", { title: "milliseconds: queue · prefill (incl. KV transfer) · decode" }, bar, ` ${text}`);
}

function renderRequests(list) {
  const rows = list.data.map((r) => {
    const link = el("a", { href: `/v1/requests/${encodeURIComponent(r.id)}`, "data-id": r.id }, r.id);
    link.addEventListener("click", (ev) => { ev.preventDefault(); showRecord(r.id); });
    const kv = r.kv_path === "transferred" ? `sent ${bytes(r.kv_bytes_sent)}`
      : r.kv_path === "local" ? "recomputed locally (no transfer)" : (r.kv_path ?? "–");
    return el("tr", {},
      el("td", {}, link), el("td", { class: `status-${r.status}` }, r.status),
      el("td", {}, `${r.prompt_tokens} / ${r.output_tokens}`), el("td", {}, fmt(r.cached_tokens)),
      el("td", {}, `${r.prefill_workers.join(",") || "–"} → ${r.decode_workers.join(",") || "–"}`),
      el("td", {}, kv), el("td", {}, `${r.preemptions}p / ${r.migrations}m`),
      el("td", {}, fmt(r.ttft_ms)), el("td", {}, phaseBar(r.phases_ms)));
  });
  $("#requests tbody").replaceChildren(...rows);
}

async function showRecord(id) {
  const pre = $("#record");
  try {
    pre.textContent = JSON.stringify(await api(`/v1/requests/${encodeURIComponent(id)}`), null, 2);
  } catch (e) {
    pre.textContent = `could not load ${id}: ${e.message}`;
  }
  pre.hidden = false;
}

// -- charts -----------------------------------------------------------------------------------------

// The y axis's width: its widest tick label plus the tick marks and gap, so long labels
// ("976.6 KiB") never run into the axis title beside them.
function yAxisSize(u, values, axisIdx, cycleNum) {
  const axis = u.axes[axisIdx];
  if (cycleNum > 1 && axis._size) return axis._size;  // settled: keep the width uPlot converged on
  const widest = (values || []).reduce((w, v) => (String(v).length > w.length ? String(v) : w), "");
  u.ctx.font = axis.font[0];
  const text = widest ? u.ctx.measureText(widest).width / devicePixelRatio : 0;
  return Math.max(40, Math.ceil(text + axis.ticks.size + axis.gap + 4));
}

function chartOpts(series, yLabel, yFormat) {
  const width = Math.max(300, ($(".charts figure")?.clientWidth || 440) - 14);
  return {
    width, height: 180,
    cursor: { drag: { x: false, y: false } },
    legend: { live: false },
    scales: { x: { time: true } },
    axes: [{}, { label: yLabel, size: yAxisSize,
                 ...(yFormat ? { values: (u, ticks) => ticks.map(yFormat) } : {}) }],
    series: [{}, ...series.map((name, i) => ({
      label: name, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
    }))],
  };
}

function draw(id, names, yLabel, data, yFormat) {
  const key = `${id}:${names.join("|")}`;
  let c = charts[id];
  if (!c || c.key !== key) {
    if (c) c.plot.destroy();
    const target = $(`#${id}`);
    target.replaceChildren();
    c = charts[id] = { key, plot: new uPlot(chartOpts(names, yLabel, yFormat), data, target) };
  } else {
    c.plot.setData(data);
  }
}

function renderCharts(h, workerIds) {
  const pts = h.points;
  const t = pts.map((p) => p.t);
  const col = (k, scale = 1) => pts.map((p) => (p[k] == null ? null : p[k] * scale));
  draw("chart-ttft", ["p50", "p99"], "ms", [t, col("ttft_p50_ms"), col("ttft_p99_ms")]);
  draw("chart-tpot", ["p50", "p99"], "ms", [t, col("tpot_p50_ms"), col("tpot_p99_ms")]);
  draw("chart-tokens", ["output tokens/s"], "tok/s", [t, col("output_tokens_per_s")]);
  draw("chart-queue", ["queue depth", "running"], "requests", [t, col("queue_depth"), col("running")]);
  const ids = [...new Set([...workerIds, ...pts.flatMap((p) => Object.keys(p.kv_usage))])].sort();
  draw("chart-kv", ids, "%", [t, ...ids.map((w) =>
    pts.map((p) => (w in p.kv_usage ? 100 * p.kv_usage[w] : null)))]);
  draw("chart-bw", ["KV transfer"], "per second", [t, col("kv_transfer_bytes_per_s")],
       (v) => bytes(v));
}

// -- the loop -----------------------------------------------------------------------------------------

async function refresh() {
  if (waitingForKey) return;
  try {
    const [status, history, requests] = await Promise.all([
      api("/v1/cluster/status"), api("/v1/cluster/history"), api("/v1/requests?limit=25"),
    ]);
    renderHeader(status);
    renderCards(status);
    renderWorkers(status);
    renderAdmission(status);
    renderRequests(requests);
    renderCharts(history, status.workers.map((w) => w.id));
    const lost = status.lost_workers.map((w) =>
      `Router lost ${w.role} worker ${w.id} at ${new Date(w.since * 1000).toLocaleTimeString()}: ${w.reason}`);
    banner(lost);
    document.body.dataset.updated = String(status.time);
  } catch (e) {
    if (e instanceof Unauthorized) {
      sessionStorage.removeItem(KEY_NAME);
      banner(["This server needs its API key."]);
      askForKey();
    } else {
      banner([`Cannot reach the router: ${e.message}`]);
    }
  }
}

refresh();
setInterval(refresh, POLL_MS);
