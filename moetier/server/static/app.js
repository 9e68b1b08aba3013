// moetier chat page: streams /v1/chat/completions, keeps the conversation in the browser
// (localStorage), and draws the live panel from GET /v1/moetier/stats. No framework, works offline.
"use strict";

const $ = (id) => document.getElementById(id);
const SETTINGS = ["system", "temperature", "top_p", "top_k", "min_p", "max_tokens", "seed", "api_key"];
let history = load("moetier.history", []);   // [{role, content, reasoning?, meta?}]
let controller = null;                        // AbortController of the running request
let statsTimer = null;
// The server records a request's numbers (stats.last) just after its stream ends, so a refresh right after a
// turn can still return the turn before: a `last` this old is not shown over the turn's own usage.
let shownFinished = null;                     // stats.last.finished of the numbers on the panel
let staleFinished;                            // set when a turn of this page ends: the `last` before it

function load(key, fallback) {
  try { return JSON.parse(localStorage.getItem(key)) ?? fallback; } catch { return fallback; }
}
function save() { localStorage.setItem("moetier.history", JSON.stringify(history)); }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

// ---- markdown: fenced code blocks, inline code, bold, paragraphs (everything escaped first) ----
function escapeHtml(s) {
  return s.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}
function inline(s) {
  return escapeHtml(s)
    .replace(/`([^`\n]+)`/g, "<code>$1</code>")
    .replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
}
function markdown(text) {
  const out = [];
  const parts = text.split(/^```/m);        // even: prose, odd: code (an open fence runs to the end)
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const nl = part.indexOf("\n");
      const lang = nl < 0 ? part.trim() : part.slice(0, nl).trim();
      const code = nl < 0 ? "" : part.slice(nl + 1).replace(/\n$/, "");
      out.push(`<pre>${lang ? `<span class="lang">${escapeHtml(lang)}</span>` : ""}` +
               `<button class="copy" type="button">Copy</button><code>${escapeHtml(code)}</code></pre>`);
    } else {
      for (const para of part.replace(/^\n+|\n+$/g, "").split(/\n{2,}/)) {
        if (para.trim()) out.push(`<p>${inline(para).replace(/\n/g, "<br>")}</p>`);
      }
    }
  });
  return out.join("");
}

async function copyText(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {                                  // not a secure context: the old way
    const ta = document.createElement("textarea");
    ta.value = text; document.body.appendChild(ta); ta.select();
    document.execCommand("copy"); ta.remove();
  }
  const was = button.textContent; button.textContent = "Copied"; setTimeout(() => (button.textContent = was), 1000);
}

// ---- the conversation ----
function bubble(msg) {
  const div = document.createElement("div");
  div.className = "msg " + msg.role;
  const role = document.createElement("div");
  role.className = "role";
  role.innerHTML = `<span>${msg.role === "user" ? "you" : msg.role}</span><span class="grow"></span>`;
  const copy = document.createElement("button");
  copy.className = "copy"; copy.type = "button"; copy.textContent = "Copy";
  copy.addEventListener("click", () => copyText(msg.content, copy));
  role.appendChild(copy);
  const body = document.createElement("div");
  body.className = "body";
  div.append(role, body);
  div.addEventListener("click", (e) => {
    if (e.target.matches("pre button.copy")) copyText(e.target.parentElement.querySelector("code").textContent, e.target);
  });
  fill(div, msg);
  $("log").appendChild(div);
  return div;
}

function fill(div, msg) {
  const body = div.querySelector(".body");
  if (msg.role !== "assistant") { body.textContent = msg.content; return; }
  let html = "";
  if (msg.reasoning) html += `<details class="reasoning"${msg.content ? "" : " open"}><summary>reasoning</summary>${escapeHtml(msg.reasoning)}</details>`;
  html += markdown(msg.content || "");
  if (msg.meta) html += `<div class="meta">${escapeHtml(msg.meta)}</div>`;
  body.innerHTML = html;
}

function renderAll() {
  $("log").innerHTML = "";
  history.forEach(bubble);
  $("log").scrollTop = $("log").scrollHeight;
}

function setBusy(busy) {
  $("send").hidden = busy; $("stop").hidden = !busy;
}

function notice(text) { $("notice").textContent = text || ""; $("notice").hidden = !text; }

function requestBody() {
  const num = (id, int) => { const v = $(id).value.trim(); if (v === "") return undefined; return int ? parseInt(v, 10) : parseFloat(v); };
  const msgs = [];
  const system = $("system").value.trim();
  if (system) msgs.push({ role: "system", content: system });
  for (const m of history) if (m.role === "user" || m.role === "assistant") msgs.push({ role: m.role, content: m.content });
  const body = { model: window.moetierModel, messages: msgs, stream: true, stream_options: { include_usage: true },
                 temperature: num("temperature"), top_p: num("top_p"), top_k: num("top_k", true),
                 min_p: num("min_p"), max_tokens: num("max_tokens", true), seed: num("seed", true) };
  return JSON.stringify(body);
}

async function send(text) {
  history.push({ role: "user", content: text });
  bubble(history[history.length - 1]);
  const body = requestBody();                 // the conversation so far, before the reply's placeholder
  const msg = { role: "assistant", content: "", reasoning: "" };
  history.push(msg);
  const div = bubble(msg);
  setBusy(true); notice("");
  controller = new AbortController();
  const t0 = performance.now();
  let tFirst = null, chunks = 0, usage = null, finish = null, pending = false;
  const redraw = () => {
    if (pending) return; pending = true;
    requestAnimationFrame(() => { pending = false; fill(div, msg); $("log").scrollTop = $("log").scrollHeight; });
  };
  const live = () => {
    if (tFirst !== null) $("stat-ttft").textContent = `${(tFirst - t0).toFixed(0)} ms`;
    const secs = (performance.now() - (tFirst ?? t0)) / 1000;
    if (chunks > 1 && secs > 0) $("stat-toks").textContent = ((chunks - 1) / secs).toFixed(1);
  };
  try {
    const res = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body,
                                                      signal: controller.signal });
    if (!res.ok) {
      let err = `${res.status} ${res.statusText}`;
      try { err = (await res.json()).error.message; } catch {}
      throw new Error(err);
    }
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut); buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (line.startsWith(":")) {                        // server comment: queue position
            const m = line.match(/queue position (\d+)/);
            $("stat-queue").textContent = m ? `#${m[1]} waiting` : "running";
            continue;
          }
          if (!line.startsWith("data: ")) continue;
          const data = line.slice(6);
          if (data === "[DONE]") continue;
          const obj = JSON.parse(data);
          if (obj.error) throw new Error(obj.error.message);
          if (obj.usage) usage = obj.usage;
          const choice = obj.choices && obj.choices[0];
          if (!choice) continue;
          if (choice.finish_reason) finish = choice.finish_reason;
          const d = choice.delta || {};
          if (d.content || d.reasoning_content) {
            if (tFirst === null) { tFirst = performance.now(); $("stat-queue").textContent = "running"; }
            chunks += 1;
            msg.content += d.content || "";
            msg.reasoning += d.reasoning_content || "";
            redraw(); live();
          }
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else { notice(e.message); finish = "error"; if (!msg.content) { div.classList.add("error"); msg.content = e.message; } }
  } finally {
    controller = null;
    setBusy(false);
    live();
    $("stat-finish").textContent = finish || "–";
    if (usage) {
      staleFinished = shownFinished;
      $("stat-cached").textContent = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
      $("stat-tokens").textContent = `${usage.prompt_tokens} / ${usage.completion_tokens}`;
    }
    msg.meta = [finish && `finish: ${finish}`, usage && `${usage.completion_tokens} tokens`,
                tFirst && `TTFT ${(tFirst - t0).toFixed(0)} ms`].filter(Boolean).join(" · ");
    if (!msg.reasoning) delete msg.reasoning;
    if (div.classList.contains("error")) history.splice(history.length - 2, 2);   // keep failed turns out
    fill(div, msg);
    save();
    refreshStats();
  }
}

// ---- live panel ----
async function refreshStats() {
  try {
    const res = await fetch("/v1/moetier/stats", { headers: headers() });
    if (!res.ok) { $("tier-note").textContent = res.status === 401 ? "set the API key in Settings" : `stats: ${res.status}`; return; }
    const s = await res.json();
    if (s.last && !controller && s.last.finished !== staleFinished) {
      $("stat-toks").textContent = s.last.decode_tok_s.toFixed(1);
      $("stat-ttft").textContent = `${(s.last.ttft_s * 1000).toFixed(0)} ms`;
      $("stat-cached").textContent = s.last.cached_tokens;
      shownFinished = s.last.finished;
      staleFinished = undefined;
    }
    if (!controller) $("stat-queue").textContent = s.queue.waiting ? `${s.queue.waiting} waiting` : (s.queue.running ? "busy" : "idle");
    drawTiers(s);
  } catch (e) { $("tier-note").textContent = "stats unavailable: " + e.message; }
}

const SVG = "http://www.w3.org/2000/svg";
function el(name, attrs, text) {
  const n = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) n.setAttribute(k, v);
  if (text !== undefined) n.textContent = text;
  return n;
}
function heat(rate) {                          // 0 red -> 1 green
  const r = Math.max(0, Math.min(1, rate ?? 0));
  return `hsl(${Math.round(120 * r)}, 70%, 45%)`;
}
function fmtBytes(n) {
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${u[i]}`;
}

function drawTiers(s) {
  const svg = $("tiers");
  svg.innerHTML = "";
  const mem = s.memory || {};
  const tiers = mem.tiers || {};
  const names = ["gpu", "ram", "ssd"];
  const total = names.reduce((a, t) => a + ((tiers[t] || {}).experts || 0), 0) || 1;
  const colors = { gpu: "#2f6fed", ram: "#12a150", ssd: "#d97706" };
  names.forEach((t, i) => {
    const v = tiers[t] || {};
    const y = 8 + i * 30;
    const w = 190 * (v.experts || 0) / total;
    svg.append(el("text", { x: 0, y: y + 13 }, t.toUpperCase()));
    svg.append(el("rect", { x: 34, y, width: 190, height: 18, rx: 3, fill: "rgba(127,127,127,.15)" }));
    svg.append(el("rect", { x: 34, y, width: Math.max(w, v.experts ? 1 : 0), height: 18, rx: 3, fill: colors[t],
                            class: "tier", "data-tier": t, "data-experts": v.experts || 0 }));
    const extra = v.hits !== undefined ? ` · ${v.hits} hits` : "";
    svg.append(el("text", { x: 230, y: y + 13, class: "muted" }, `${v.experts || 0}${extra}`));
  });
  const layers = mem.layers || [];
  const top = 110;
  svg.append(el("text", { x: 0, y: top - 6 }, `hit rate per layer (${layers.length} MoE layers)`));
  const lw = layers.length ? 300 / layers.length : 300;
  layers.forEach((l, i) => {
    const r = el("rect", { x: i * lw, y: top, width: Math.max(lw - (lw > 4 ? 1 : 0), 0.5), height: 22,
                           fill: heat(l.hit_rate), class: "layer", "data-layer": l.layer, "data-hit-rate": l.hit_rate });
    r.append(el("title", {}, `layer ${l.layer}: hit rate ${((l.hit_rate ?? 0) * 100).toFixed(1)}% ` +
                             `(gpu ${l.gpu ?? 0}, ram ${l.ram ?? 0}, ssd ${l.ssd ?? 0})`));
    svg.append(r);
  });
  svg.append(el("text", { x: 0, y: top + 38, class: "muted" }, "0%"));
  svg.append(el("rect", { x: 18, y: top + 30, width: 60, height: 9, fill: "url(#heat)" }));
  svg.append(el("text", { x: 82, y: top + 38, class: "muted" }, "100%"));
  const defs = el("defs", {});
  const grad = el("linearGradient", { id: "heat" });
  grad.append(el("stop", { offset: "0", "stop-color": heat(0) }), el("stop", { offset: "0.5", "stop-color": heat(0.5) }),
              el("stop", { offset: "1", "stop-color": heat(1) }));
  defs.append(grad); svg.prepend(defs);
  const p = s.process || {};
  const rate = mem.hit_rate !== undefined ? `overall hit rate ${(mem.hit_rate * 100).toFixed(1)}%` : "";
  svg.append(el("text", { x: 0, y: top + 62, class: "muted" },
                `${rate}  RAM ${fmtBytes(p.ram_bytes || 0)}  VRAM ${fmtBytes(p.vram_bytes || 0)}`));
  svg.dataset.updated = String(Number(svg.dataset.updated || 0) + 1);
  $("tier-note").textContent = `${s.model} on ${s.device} (${s.dtype}), ${s.sessions.count} cached conversation(s)`;
}

// ---- wiring ----
function init() {
  const saved = load("moetier.settings", {});
  for (const id of SETTINGS) {
    if (saved[id] !== undefined) $(id).value = saved[id];
    $(id).addEventListener("change", () => {
      const now = {}; for (const k of SETTINGS) now[k] = $(k).value;
      localStorage.setItem("moetier.settings", JSON.stringify(now));
      if (id === "api_key") { loadModel(); refreshStats(); }
    });
  }
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value;
    if (!text.trim() || controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => { if (controller) controller.abort(); history = []; save(); renderAll(); });
  renderAll();
  loadModel();
  refreshStats();
  statsTimer = setInterval(() => { if (!document.hidden) refreshStats(); }, 3000);
}

async function loadModel() {
  try {
    const res = await fetch("/v1/models", { headers: headers() });
    if (res.status === 401) { $("model").textContent = "API key needed (Settings)"; notice("This server needs an API key: enter it under Settings."); return; }
    const data = await res.json();
    window.moetierModel = data.data[0].id;
    $("model").textContent = `${data.data[0].id} · context ${data.data[0].max_model_len}`;
    notice("");
  } catch (e) { $("model").textContent = "server unreachable"; }
}

init();
