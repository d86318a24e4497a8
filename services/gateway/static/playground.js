// pdserve playground: streaming chat against /v1/chat/completions, and per answer the
// request's pipeline timeline from /debug/timeline/<id> drawn as bars. Plain JS, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const history = [];

// phase name (shared/timeline.py PHASES) -> the stage group its bar is coloured by
function groupOf(phase) {
  if (phase.startsWith("queue.") || phase === "gateway") return "queue";
  if (phase === "tokenize") return "tokenize";
  if (phase === "prefill") return "prefill";
  if (phase === "kv_put" || phase === "kv_get" || phase === "admit") return "handoff";
  if (phase === "decode") return "decode";
  if (phase === "postfilter" || phase === "respond") return "postfilter";
  return "other";
}
const GROUPS = [["queue", "queue"], ["tokenize", "tokenize"], ["prefill", "prefill"],
  ["handoff", "KV hand-off"], ["decode", "decode"], ["postfilter", "postfilter"]];

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function loadModels() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    const select = $("model");
    select.innerHTML = "";
    for (const m of body.data || []) {
      const opt = document.createElement("option");
      opt.value = opt.textContent = m.id;
      select.appendChild(opt);
    }
  } catch (e) {
    console.warn("model list failed", e);
  }
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.innerHTML = '<div class="role"></div><div class="content"></div>';
  div.querySelector(".role").textContent = role;
  div.querySelector(".content").textContent = text;
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function requestBody() {
  const body = { model: $("model").value, messages: [], stream: true,
    temperature: Number($("temperature").value), top_p: Number($("top-p").value),
    max_tokens: parseInt($("max-tokens").value, 10) };
  const system = $("system").value.trim();
  if (system) body.messages.push({ role: "system", content: system });
  body.messages.push(...history);
  if ($("seed").value !== "") body.seed = parseInt($("seed").value, 10);
  const stop = $("stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  return body;
}

// Reads an SSE body; calls onEvent(json) for each data event, stops at [DONE].
async function readSSE(response, onEvent) {
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
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function fetchTimeline(id) {
  // the gateway records the timeline right after [DONE]: retry briefly
  for (let i = 0; i < 20; i++) {
    const r = await fetch("/debug/timeline/" + encodeURIComponent(id), { headers: headers() });
    if (r.ok) return r.json();
    await new Promise((res) => setTimeout(res, 100));
  }
  return null;
}

function drawTimeline(box, tl) {
  const choice = tl.choices && tl.choices[0];
  if (!choice) return;
  const total = Math.max(tl.e2e_ms, 1e-3);
  const wrap = document.createElement("div");
  wrap.className = "timeline";
  const legend = document.createElement("div");
  legend.className = "legend";
  for (const [g, label] of GROUPS) legend.insertAdjacentHTML("beforeend", `<span><i class="swatch g-${g}"></i>${label}</span>`);
  wrap.appendChild(legend);
  let at = 0;
  for (const p of choice.phases) {
    const row = document.createElement("div");
    row.className = "row";
    row.innerHTML = '<span class="name"></span><span class="track"><span class="bar"></span></span><span class="ms"></span>';
    row.querySelector(".name").textContent = p.phase;
    const bar = row.querySelector(".bar");
    bar.classList.add("g-" + groupOf(p.phase));
    bar.dataset.phase = p.phase;
    bar.style.left = (100 * at / total).toFixed(3) + "%";
    bar.style.width = (100 * p.ms / total).toFixed(3) + "%";
    bar.title = `${p.phase}: ${p.ms.toFixed(1)} ms`;
    row.querySelector(".ms").textContent = p.ms.toFixed(1) + " ms";
    wrap.appendChild(row);
    at += p.ms;
  }
  box.appendChild(wrap);
}

function showStats(box, s) {
  const div = document.createElement("div");
  div.className = "stats";
  const fmt = (v) => (v == null ? "–" : v.toFixed(1) + " ms");
  div.innerHTML = `<span>TTFT <b class="ttft">${fmt(s.ttft)}</b></span>` +
    `<span>ITL (mean) <b class="itl">${fmt(s.itl)}</b></span>` +
    `<span>end-to-end <b>${fmt(s.e2e)}</b></span><span>chunks <b>${s.chunks}</b></span>` +
    (s.finish ? `<span>finish <b>${s.finish}</b></span>` : "") +
    (s.spec && s.spec.acceptance_rate != null
      ? `<span>speculation: accepted <b class="spec">${(100 * s.spec.acceptance_rate).toFixed(0)}%</b>, ` +
        `<b>${s.spec.tokens_per_step.toFixed(2)}</b> tokens/step</span>` : "");
  box.appendChild(div);
}

async function send(text) {
  history.push({ role: "user", content: text });
  addMessage("user", text);
  const box = addMessage("assistant", "");
  const content = box.querySelector(".content");
  $("send").disabled = true;
  const started = performance.now();
  const arrivals = [];
  let id = null, finish = null, answer = "";
  try {
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(requestBody()) });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || `HTTP ${r.status}`);
    }
    await readSSE(r, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      id = chunk.id || id;
      const c = chunk.choices && chunk.choices[0];
      if (!c) return;
      const piece = (c.delta && c.delta.content) || "";
      if (piece) {
        arrivals.push(performance.now());
        answer += piece;
        content.textContent = answer;
      }
      if (c.finish_reason) finish = c.finish_reason;
    });
    history.push({ role: "assistant", content: answer });
    const gaps = arrivals.slice(1).map((t, i) => t - arrivals[i]);
    const tl = id ? await fetchTimeline(id) : null;
    showStats(box, { ttft: tl && tl.ttft_ms != null ? tl.ttft_ms : (arrivals.length ? arrivals[0] - started : null),
      itl: gaps.length ? gaps.reduce((a, b) => a + b, 0) / gaps.length : null,
      e2e: tl ? tl.e2e_ms : performance.now() - started, chunks: arrivals.length, finish,
      spec: tl && tl.choices && tl.choices[0] ? tl.choices[0].speculation : null });
    if (tl) drawTimeline(box, tl);
  } catch (e) {
    box.classList.add("error");
    content.textContent = (answer ? answer + "\n" : "") + "Error: " + e.message;
    history.pop();
  } finally {
    $("send").disabled = false;
    box.scrollIntoView({ block: "end" });
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || $("send").disabled) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});
$("clear").addEventListener("click", () => {
  history.length = 0;
  $("messages").innerHTML = "";
});
$("api-key").addEventListener("change", loadModels);
loadModels();
