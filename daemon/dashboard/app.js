// mlxd dashboard: polls GET /v1/dashboard, draws SVG charts, and streams the playground
// through /v1/chat/completions. No library, nothing loaded from anywhere else. The API key
// (when the server wants one) is typed once and kept in this tab's sessionStorage.
"use strict";

const KEY_STORE = "mlxd.apiKey";
const POLL_MIN_MS = 2000;  // one poll and one redraw per 2 s at most (each sample still comes)
const $ = (id) => document.getElementById(id);
const state = {
  samples: [], recent: [], since: 0, recentSince: 0, periodS: 1, historyS: 900,
  timer: null, models: [], chat: null,
};

// ---- the key and the requests ---------------------------------------------------------

function authHeaders(extra = {}) {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

async function api(path, options = {}) {
  const response = await fetch(path, { ...options, headers: authHeaders(options.headers) });
  if (response.status === 401) {
    showKeyPanel(sessionStorage.getItem(KEY_STORE) ? "That key was refused." : "");
    throw new Error("unauthorized");
  }
  return response;
}

function showKeyPanel(message) {
  $("key-panel").hidden = false;
  $("key-error").hidden = !message;
  $("key-error").textContent = message;
  setBadge($("state"), "locked");
  $("key-input").focus();
}

function setupKey() {
  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY_STORE, key);
    $("key-input").value = "";
    $("key-panel").hidden = true;
    restart();
  });
  $("key-forget").addEventListener("click", () => {
    sessionStorage.removeItem(KEY_STORE);
    showKeyPanel("");
  });
  $("key-button").addEventListener("click", () => {
    const panel = $("key-panel");
    panel.hidden = !panel.hidden;
  });
}

// ---- polling ----------------------------------------------------------------------------

function restart() {
  state.samples = []; state.recent = []; state.since = 0; state.recentSince = 0;
  state.modelsKey = null;
  clearTimeout(state.timer);
  poll();
}

async function poll() {
  clearTimeout(state.timer);
  try {
    const query = `since=${state.since}&recent_since=${state.recentSince}`;
    const response = await api(`/v1/dashboard?${query}`);
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (error) {
    if (error.message === "unauthorized") return;  // waits for a key
    setBadge($("state"), "offline");
    $("updated").textContent = `no answer (${error.message}); retrying`;
  }
  const period = Math.max(POLL_MIN_MS, state.periodS * 1000);
  state.timer = setTimeout(poll, document.hidden ? period * 5 : period);
}

function render(view) {
  state.periodS = view.sample_period_s;
  state.historyS = view.history_s;
  state.since = view.next_sample;
  state.recentSince = view.next_recent;
  const oldest = view.now - view.history_s;
  state.samples = state.samples.concat(view.samples).filter((s) => s.t > oldest);
  const newRequests = view.recent.length > 0;
  state.recent = state.recent.concat(view.recent).slice(-100);
  setBadge($("state"), view.state);
  $("uptime").textContent = `up ${duration(view.uptime_s)}`;
  $("updated").textContent = `updated ${new Date(view.now * 1000).toLocaleTimeString()}`;
  $("window").textContent = duration(view.history_s);
  renderCards(view);
  renderModels(view.models);
  renderCharts(view.now);
  if (newRequests || !state.recent.length) renderRecent();
}

function renderCards(view) {
  const m = view.last_minute;
  $("c-running").textContent = view.admission.running;
  $("c-queued").textContent = view.admission.waiting;
  $("c-tps").textContent = m.tokens_per_s.toFixed(1);
  $("c-ttft").textContent = `${seconds(m.ttft_p50)} / ${seconds(m.ttft_p95)}`;
  $("c-cache").textContent = view.cache.prompt_tokens ? percent(view.cache.hit_rate) : "–";
  $("c-memory").textContent = `${bytes(view.memory.active_bytes)} / ${bytes(view.memory.peak_bytes)}`;
}

// ---- models -------------------------------------------------------------------------------

function renderModels(models) {
  const key = JSON.stringify(models);
  if (key === state.modelsKey) return;  // unchanged: keep the rows (and a pending click)
  state.modelsKey = key;
  state.models = models;
  const body = $("models").tBodies[0];
  body.replaceChildren(...models.map(modelRow));
  const select = $("chat-model");
  const chosen = select.value;
  const ids = models.map((m) => m.id);
  if (ids.join("\n") !== Array.from(select.options, (o) => o.value).join("\n")) {
    select.replaceChildren(...ids.map((id) => new Option(id, id)));
    if (ids.includes(chosen)) select.value = chosen;
  }
}

function modelRow(m) {
  const tr = document.createElement("tr");
  tr.dataset.model = m.id;
  const stateCell = cell("");
  const badge = document.createElement("span");
  setBadge(badge, m.state);
  stateCell.append(badge);
  if (m.state === "loaded") {  // idle: nothing for it in flight (an unload may go ahead)
    const activity = document.createElement("span");
    activity.className = "muted activity";
    activity.textContent = m.open_requests ? " busy" : " idle";
    stateCell.append(activity);
  }
  if (m.error) {
    const error = document.createElement("div");
    error.className = "error";
    error.textContent = m.error;
    stateCell.append(error);
  }
  const actions = cell("");
  const busy = m.state === "loading";
  if (!m.parent) {  // a LoRA adapter loads with its base (and unloads by its own route)
    actions.append(
      button("Load", "load", m, busy || m.state === "loaded"),
      button("Unload", "unload", m, m.state !== "loaded"),
    );
  }
  const idCell = cell(m.id);
  if (m.parent) {
    tr.className = "adapter";
    const base = document.createElement("div");
    base.className = "muted";
    base.textContent = `LoRA adapter on ${m.parent}`;
    idCell.append(base);
  }
  tr.append(
    idCell, stateCell, cell(m.kind || "–"), cell(bytes(m.weights_bytes), true),
    cell(bytes(m.kv_reserved_bytes), true), preemptedCell(m),
    cell(`${m.open_requests} / ${m.finished_requests}`, true),
    cell(`${m.loads} / ${m.unloads}`, true), actions,
  );
  return tr;
}

function preemptedCell(m) {
  const td = cell(`${m.preemptions} / ${m.resumes}`, true);
  td.title = `${bytes(m.preempted_bytes)} of snapshots left, ${m.preempted_seconds.toFixed(1)} s out`;
  return td;
}

function button(label, action, model, disabled) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.dataset.action = action;
  b.disabled = disabled;
  b.addEventListener("click", () => modelAction(model.id, action, b));
  return b;
}

async function modelAction(id, action, b) {
  b.disabled = true;
  $("model-error").hidden = true;
  try {
    const response = await api(`/v1/models/${encodeURIComponent(id)}/${action}`, {
      method: "POST", headers: { "Content-Type": "application/json" }, body: "{}",
    });
    if (!response.ok) throw new Error(await errorText(response));
  } catch (error) {
    if (error.message !== "unauthorized") {
      $("model-error").hidden = false;
      $("model-error").textContent = `${action} ${id}: ${error.message}`;
    }
  }
  poll();
}

// ---- charts ---------------------------------------------------------------------------------

function renderCharts(now) {
  const from = now - state.historyS;
  const series = (key) => state.samples.map((s) => [s.t, s[key]]);
  const count = (v) => (Number.isInteger(v) ? String(v) : v.toFixed(1));
  lineChart($("chart-tps"), [series("tokens_per_s")], from, now, count);
  lineChart($("chart-ttft"), [series("ttft_p50"), series("ttft_p95")], from, now, seconds);
  lineChart($("chart-requests"), [series("running"), series("queued")], from, now, count);
  lineChart($("chart-cache"), [series("cache_hit_rate")], from, now, percent, 1);
  lineChart($("chart-spec"), [series("spec_acceptance")], from, now, percent, 1);
}

const SVG = "http://www.w3.org/2000/svg";

function svgEl(name, attributes) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attributes)) el.setAttribute(k, v);
  return el;
}

// One SVG line chart: each series a list of [t, value] (null: a gap), x from..to.
function lineChart(svg, series, from, to, format, fixedMax) {
  const w = svg.clientWidth || 400, h = svg.clientHeight || 150;
  const left = 44, right = 6, top = 6, bottom = 16;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  const values = series.flat().map(([, v]) => v).filter((v) => v !== null && v !== undefined);
  const max = fixedMax || niceMax(Math.max(0, ...values));
  const x = (t) => left + ((t - from) / (to - from)) * (w - left - right);
  const y = (v) => top + (1 - v / max) * (h - top - bottom);
  const children = [];
  for (const fraction of [0, 0.5, 1]) {
    const v = max * fraction;
    children.push(svgEl("line", { class: "grid", x1: left, x2: w - right, y1: y(v), y2: y(v) }));
    const label = svgEl("text", { x: left - 4, y: y(v) + 3, "text-anchor": "end" });
    label.textContent = format(v);
    children.push(label);
  }
  const minutes = Math.round((to - from) / 60);
  const start = svgEl("text", { x: left, y: h - 3 });
  start.textContent = `−${minutes} min`;
  const end = svgEl("text", { x: w - right, y: h - 3, "text-anchor": "end" });
  end.textContent = "now";
  children.push(start, end);
  series.forEach((points, i) => {
    let d = "", run = [];
    const flush = () => {  // a point alone (gaps on both sides) is drawn as a dot
      if (run.length === 1) {
        children.push(svgEl("circle", { class: `d${i}`, cx: run[0][0], cy: run[0][1], r: 2.5 }));
      } else if (run.length) {
        d += `M${run.map((p) => p.join(",")).join("L")}`;
      }
      run = [];
    };
    for (const [t, v] of points) {
      if (v === null || v === undefined || t < from) { flush(); continue; }
      run.push([x(t).toFixed(1), y(Math.min(v, max)).toFixed(1)]);
    }
    flush();
    if (d) children.push(svgEl("path", { class: `s${i}`, d }));
  });
  svg.replaceChildren(...children);
  svg.dataset.points = values.length;  // what the chart holds (the browser tests read it)
  svg.dataset.max = values.length ? Math.max(...values) : 0;
}

function niceMax(v) {
  if (v <= 0) return 1;
  const step = 10 ** Math.floor(Math.log10(v));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * step >= v) return m * step;
  return 10 * step;
}

// ---- recent requests ------------------------------------------------------------------------

function renderRecent() {
  const rows = state.recent.slice().reverse().map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.id = r.id;
    tr.append(
      cell(new Date(r.t * 1000).toLocaleTimeString()), cell(r.id), cell(r.model), cell(r.api || "–"),
      cell(r.prompt_tokens, true), cell(r.cached_tokens, true), cell(r.generated_tokens, true),
      cell(seconds(r.ttft_s), true), cell(seconds(r.duration_s), true),
      cell(r.code ? `${r.status} ${r.code}` : r.status), cell(r.finish_reason || "–"),
    );
    return tr;
  });
  $("recent").tBodies[0].replaceChildren(...rows);
}

// ---- playground -------------------------------------------------------------------------------

function setupChat() {
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    chat();
  });
  $("chat-stop").addEventListener("click", () => state.chat && state.chat.abort());
}

async function chat() {
  const message = $("chat-message").value.trim();
  if (!message || state.chat) return;
  const messages = [];
  const system = $("chat-system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  messages.push({ role: "user", content: message });
  const body = {
    model: $("chat-model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("chat-temperature").value), max_tokens: Number($("chat-max-tokens").value),
  };
  const output = $("chat-output"), stats = $("chat-stats");
  output.textContent = ""; stats.textContent = "waiting…"; $("chat-error").hidden = true;
  state.chat = new AbortController();
  $("chat-send").disabled = true; $("chat-stop").disabled = false;
  const started = performance.now();
  const timing = { first: null, last: null, tokens: null };
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body), signal: state.chat.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      const text = delta ? (delta.reasoning_content || "") + (delta.content || "") : "";
      if (text) {
        timing.first = timing.first || performance.now();
        timing.last = performance.now();
        output.textContent += text;
      }
      if (chunk.usage) timing.tokens = chunk.usage.completion_tokens;
      stats.textContent = chatStats(started, timing);
    });
    stats.textContent = chatStats(started, timing) + " · done";
  } catch (error) {
    if (error.name !== "AbortError" && error.message !== "unauthorized") {
      $("chat-error").hidden = false;
      $("chat-error").textContent = error.message;
    }
    stats.textContent = chatStats(started, timing) + " · stopped";
  } finally {
    state.chat = null;
    $("chat-send").disabled = false; $("chat-stop").disabled = true;
  }
}

// Server-sent events: each `data:` line's JSON to `onChunk`, until [DONE].
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data:")) continue;
        const data = line.slice(5).trim();
        if (data === "[DONE]") return;
        onChunk(JSON.parse(data));
      }
    }
  }
}

function chatStats(started, timing) {
  if (!timing.first) return "waiting…";
  const ttft = (timing.first - started) / 1000;
  let text = `TTFT ${seconds(ttft)}`;
  if (timing.tokens !== null) {
    const span = (timing.last - timing.first) / 1000;
    const rate = timing.tokens > 1 && span > 0 ? (timing.tokens - 1) / span : null;
    text += ` · ${timing.tokens} tokens`;
    if (rate !== null) text += ` · ${rate.toFixed(1)} tok/s`;
  }
  return text;
}

// ---- formatting ---------------------------------------------------------------------------------

async function errorText(response) {
  try {
    const body = await response.json();
    return (body.error && body.error.message) || `HTTP ${response.status}`;
  } catch {
    return `HTTP ${response.status}`;
  }
}

function cell(text, numeric = false) {
  const td = document.createElement("td");
  td.textContent = text;
  if (numeric) td.className = "num";
  return td;
}

function setBadge(el, text) {
  el.textContent = text;
  el.className = `badge ${text}`;
}

function seconds(v) {
  if (v === null || v === undefined) return "–";
  return v < 1 ? `${(v * 1000).toFixed(0)} ms` : `${v.toFixed(2)} s`;
}

function percent(v) {
  return v === null || v === undefined ? "–" : `${(v * 100).toFixed(0)}%`;
}

function bytes(v) {
  if (!v) return "0";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  const i = Math.min(units.length - 1, Math.floor(Math.log2(v) / 10));
  return `${(v / 1024 ** i).toFixed(i ? 1 : 0)} ${units[i]}`;
}

function duration(s) {
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
}

document.addEventListener("DOMContentLoaded", () => {
  setupKey();
  setupChat();
  poll();
});
