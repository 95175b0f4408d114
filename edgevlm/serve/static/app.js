// The edgevlm web page: chat with pictures over the server's OpenAI API, see what each picture
// costs before it is sent, and watch the memory plan. Plain JavaScript, nothing from the network.
"use strict";

const $ = (id) => document.getElementById(id);
const state = {
  history: [],        // the messages as sent to /v1/chat/completions (OpenAI's shape)
  bubbles: [],        // the page element of each history entry
  attachments: [],    // {name, url, budget, error, node}
  model: "edgevlm",
  nCtx: null,
  controller: null,   // the reply being streamed (Stop aborts it)
  cacheSource: null,  // where the last reply's cached tokens were: resident, host, disk
};

// --- the API, with the key asked once and kept for this tab ------------------------------------
function authHeaders() {
  const key = sessionStorage.getItem("edgevlm-api-key");
  return key ? { Authorization: `Bearer ${key}` } : {};
}

let asking = null;
function askKey() {
  if (!asking) {
    asking = new Promise((resolve) => {
      const dialog = $("key-dialog");
      $("key-form").onsubmit = () => {
        sessionStorage.setItem("edgevlm-api-key", $("key").value);
        asking = null;
        resolve();
      };
      dialog.showModal();
      $("key").focus();
    });
  }
  return asking;
}

async function api(path, options = {}) {
  for (;;) {
    const resp = await fetch(path, { ...options, headers: { ...(options.headers || {}), ...authHeaders() } });
    if (resp.status !== 401) return resp;
    await askKey();
  }
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    return (body.error && body.error.message) || `HTTP ${resp.status}`;
  } catch (e) {
    return `HTTP ${resp.status}`;
  }
}

// --- the conversation ----------------------------------------------------------------------------
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function addToLog(node) {
  const hint = $("hint");
  if (hint) hint.remove();
  $("log").appendChild(node);
  node.scrollIntoView({ block: "end" });
  return node;
}

function maxTokens() {
  return Number($("max-tokens").value) || 256;
}

function note(text, cls = "note") {
  return addToLog(el("p", cls, text));
}

function userBubble(text, pictures) {
  const node = el("div", "msg user");
  node.setAttribute("aria-label", "You");
  if (pictures.length) {
    const pics = el("div", "pics");
    for (const p of pictures) {
      for (const src of p.video ? (p.budget ? p.budget.thumbnails : []) : [p.url]) {  // a clip: its frames
        const img = el("img");
        img.src = src;
        img.alt = p.name || "picture";
        pics.appendChild(img);
      }
    }
    node.appendChild(pics);
  }
  node.appendChild(document.createTextNode(text));
  return addToLog(node);
}

function fmt(n) {
  return Number(n).toLocaleString("en-US");
}

function setContextUse(used) {
  if (state.nCtx) $("ctx").textContent = `context ${fmt(used)} / ${fmt(state.nCtx)} tokens`;
}

// where a reply's cached prompt tokens were (the reply's edgevlm.cache.source)
const SOURCES = { resident: "resident in the KV cache", host: "host RAM", disk: "disk (--cache-dir)" };

function applyExtension(ext, sentLength) {
  if (ext.cache) {
    state.cacheSource = ext.cache.source;
    renderConversationSource();
  }
  // What the server did to the history to make room: show it and send the shorter one next time.
  for (const s of ext.summaries || []) {
    if (s.message < state.history.length) {
      state.history[s.message] = { role: "user", content: s.content };
      note(`Context full: picture ${s.picture} was replaced by the model's summary: ${s.summary}`);
      const pics = state.bubbles[s.message] && state.bubbles[s.message].querySelector(".pics");
      if (pics) pics.style.opacity = "0.4";
    }
  }
  const dropped = (ext.dropped_messages || []).filter((i) => i < sentLength).sort((a, b) => b - a);
  for (const i of dropped) {
    state.history.splice(i, 1);
    const [bubble] = state.bubbles.splice(i, 1);
    if (bubble) bubble.classList.add("dropped");
  }
  if (dropped.length) note(`Context full: the ${dropped.length} oldest message(s) were dropped.`);
  for (const n of ext.notices || []) {
    if (!/replaced by its summary|oldest turn was dropped/.test(n)) note(n);
  }
}

async function send() {
  const text = $("input").value.trim();
  if (state.attachments.some((a) => !a.error && !a.budget)) {  // a clip goes as its frames were shown
    note("Still measuring an attachment: send again in a moment.");
    return;
  }
  const pictures = state.attachments.filter((a) => !a.error && a.url);
  if (!text && !pictures.length) return;
  if (state.controller) return;
  const content = [{ type: "text", text }];
  for (const p of pictures) {
    if (p.video) content.push({ type: "video_url", video_url: { url: p.url }, name: p.name });
    else content.push({ type: "image_url", image_url: { url: p.url }, name: p.name });
  }
  const message = { role: "user", content: pictures.length ? content : text };
  state.history.push(message);
  state.bubbles.push(userBubble(text, pictures));
  $("input").value = "";
  clearAttachments();

  const bubble = addToLog(el("div", "msg assistant streaming"));
  bubble.setAttribute("aria-label", "Assistant");
  const body = bubble.appendChild(el("span", "text"));
  const controller = new AbortController();
  state.controller = controller;
  $("stop").disabled = false;
  $("send").disabled = true;
  let reply = "";
  let usage = null;
  let finish = null;
  let failed = null;
  const sentLength = state.history.length;
  state.cacheSource = null;
  try {
    const resp = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      signal: controller.signal,
      body: JSON.stringify({
        model: state.model, messages: state.history, stream: true, stream_options: { include_usage: true },
        max_tokens: maxTokens(), edgevlm: { evict: "summary" },
      }),
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut).trim();
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ")) continue;
        const data = event.slice(6);
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        if (chunk.edgevlm) applyExtension(chunk.edgevlm, sentLength);
        for (const c of chunk.choices || []) {
          if (c.delta && c.delta.content) {
            reply += c.delta.content;
            body.textContent = reply;
            bubble.scrollIntoView({ block: "end" });
          }
          if (c.finish_reason) finish = c.finish_reason;
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else failed = e.message;
  } finally {
    state.controller = null;
    $("stop").disabled = true;
    $("send").disabled = false;
    bubble.classList.remove("streaming");
  }
  if (failed !== null) {
    bubble.classList.add("error");
    body.textContent = failed;
    state.history.pop();  // the server did not take it: do not send it again
    state.bubbles.pop().classList.add("dropped");
    return;
  }
  state.history.push({ role: "assistant", content: reply });
  state.bubbles.push(bubble);
  const meta = [];
  if (finish === "stopped") meta.push("stopped");
  else if (finish === "length") meta.push("cut at max tokens");
  if (usage) {
    const cached = (usage.prompt_tokens_details || {}).cached_tokens || 0;
    const from = cached && state.cacheSource ? `, from ${SOURCES[state.cacheSource] || state.cacheSource}` : "";
    meta.push(`prompt ${fmt(usage.prompt_tokens)} tokens (${fmt(cached)} cached${from})`, `reply ${fmt(usage.completion_tokens)}`);
    setContextUse(usage.total_tokens);
  }
  if (meta.length) bubble.appendChild(el("span", "meta", meta.join(" · ")));
}

function newConversation() {
  if (state.controller) state.controller.abort();
  state.history = [];
  state.bubbles = [];
  state.cacheSource = null;
  renderConversationSource();
  $("log").replaceChildren();
  $("ctx").textContent = "";
  note("New conversation.");
}

// --- pictures before they are sent: what they will cost ------------------------------------------
function clearAttachments() {
  state.attachments = [];
  $("attachments").replaceChildren();
}

function drawBudget(canvas, image, budget) {
  const scale = Math.min(1, 400 / Math.max(image.naturalWidth, image.naturalHeight));
  canvas.width = Math.max(1, Math.round(image.naturalWidth * scale));
  canvas.height = Math.max(1, Math.round(image.naturalHeight * scale));
  const g = canvas.getContext("2d");
  g.drawImage(image, 0, 0, canvas.width, canvas.height);
  const sx = canvas.width / budget.width;
  const sy = canvas.height / budget.height;
  g.lineWidth = 2;
  for (const v of budget.views) {
    const [x0, y0, x1, y1] = v.box;
    const whole = v.label === "image" || v.label === "global view";
    g.strokeStyle = whole ? "#2f6fdf" : v.selected ? "#2e9e5b" : "rgba(120,120,120,.8)";
    if (!whole && v.selected) {
      g.fillStyle = "rgba(46,158,91,.18)";
      g.fillRect(x0 * sx, y0 * sy, (x1 - x0) * sx, (y1 - y0) * sy);
    }
    g.strokeRect(x0 * sx + 1, y0 * sy + 1, (x1 - x0) * sx - 2, (y1 - y0) * sy - 2);
  }
}

function isVideo(file) {
  return (file.type || "").startsWith("video/") || /\.(mp4|webm|mov|mkv|avi|m4v)$/i.test(file.name || "");
}

async function addPicture(file) {
  const video = isVideo(file);
  const item = { name: file.name || "pasted picture", url: null, budget: null, error: null, video };
  const node = el("li", "att");
  const canvas = node.appendChild(el("canvas"));
  canvas.setAttribute("role", "img");
  canvas.setAttribute("aria-label", `${item.name}: its views`);
  const cost = node.appendChild(el("p", "cost", `${item.name}: measuring…`));
  const row = node.appendChild(el("div", "row"));
  row.appendChild(el("span", "small", item.name));
  const remove = row.appendChild(el("button", "", "Remove"));
  remove.type = "button";
  remove.setAttribute("aria-label", `Remove ${item.name}`);
  remove.onclick = () => {
    state.attachments = state.attachments.filter((a) => a !== item);
    node.remove();
  };
  item.node = node;
  state.attachments.push(item);
  $("attachments").appendChild(node);

  item.url = await new Promise((resolve) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => resolve(null);
    reader.readAsDataURL(file);
  });
  try {
    const resp = await api("/v1/edgevlm/budget", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(video ? { video_url: { url: item.url }, name: item.name, max_tokens: maxTokens() }
                                 : { image_url: { url: item.url }, name: item.name }),
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    item.budget = await resp.json();
  } catch (e) {
    item.error = e.message;
    node.classList.add("error");
    cost.textContent = item.error;  // the server's message names the picture
    canvas.remove();
    return;
  }
  const b = item.budget;
  if (video) {  // its frames, as the model will see them, and what they cost
    canvas.remove();
    const strip = node.insertBefore(el("div", "frames"), cost);
    const kept = b.frames.filter((f) => f.kept);
    kept.forEach((f, i) => {
      const img = strip.appendChild(el("img"));
      img.src = b.thumbnails[i];
      img.alt = `${item.name} at ${f.label}`;
      img.title = `${f.label} · ${fmt(f.tokens)} tokens`;
    });
    cost.textContent = `${kept.length} of ${b.frames.length} frames · ${fmt(b.total_tokens)} tokens of ${fmt(b.budget)} · ${b.duration.toFixed(1)} s`;
    cost.title = b.rule + (b.notes && b.notes.length ? "; " + b.notes.join("; ") : "");
    return;
  }
  const views = b.views.filter((v) => v.selected).length;
  let text = `${fmt(b.total_tokens)} tokens · ${b.kind}`;
  if (views > 1) text += ` · ${views} views (overview + tiles)`;
  const sent = b.views[0] && b.views[0].size;
  if (sent && (sent[0] !== b.width || sent[1] !== b.height) && views === 1) text += ` · resized ${b.width}×${b.height} → ${sent[0]}×${sent[1]}`;
  cost.textContent = text;
  if (b.notes && b.notes.length) cost.title = b.notes.join("; ");
  const image = new Image();
  image.onload = () => drawBudget(canvas, image, b);
  image.src = item.url;
}

function addFiles(files) {
  for (const f of files) {
    if (f.type && !/^(image|video)\//.test(f.type) && f.type !== "application/octet-stream" && !isVideo(f)) {
      note(`${f.name}: not a picture or a video (${f.type}), not attached`, "note error");
      continue;
    }
    addPicture(f);
  }
}

// --- the live panel -------------------------------------------------------------------------------
function mib(n) {
  return n >= 2 ** 30 ? `${(n / 2 ** 30).toFixed(1)} GiB` : `${Math.round(n / 2 ** 20)} MiB`;
}

function renderStatus(st) {
  $("model").textContent = st.model || state.model;
  const server = $("server");
  const rows = [["state", st.state]];
  if (st.state === "ready") {
    state.nCtx = st.context.n_ctx;
    const r = st.requests;
    const predicted = Object.values(st.memory.predicted || {}).reduce((a, b) => a + b, 0);
    rows.push(
      ["sequences busy", `${st.slots.busy} / ${st.slots.max_running}`],
      ["queue", `${st.queue.waiting} waiting (holds ${st.queue.limit})`],
      ["KV cells", `${fmt(st.context.cells_used)} / ${fmt(st.context.n_ctx)}`],
      ["memory predicted", mib(predicted)],
      ["memory measured", `${mib(st.memory.measured.process_rss_bytes)} (this process)`],
      ["requests", `${r.served} served · ${r.cancelled} stopped · ${r.failed} failed · ${r.rejected} busy`],
      ["tokens", `${fmt(r.generated_tokens)} generated · ${fmt(r.cached_tokens)} reused`],
      ["conversations kept", keptText(st.kv)],
    );
    renderPlan(st.plan);
  } else if (st.error) {
    rows.push(["error", st.error]);
  }
  server.replaceChildren();
  for (const [k, v] of rows) {
    server.appendChild(el("dt", "", k));
    server.appendChild(el("dd", "", String(v)));
  }
}

function keptText(kv) {
  const host = kv.host_cache || {};
  const parts = [`${kv.conversations} resident`, `${host.conversations || 0} in host RAM`];
  if (host.disk) parts.push(`${host.disk.conversations} on disk`);
  return parts.join(" · ");
}

function renderConversationSource() {
  // this page's conversation: where its last reply found its cached tokens
  const box = $("source");
  if (!box) return;
  box.textContent = state.cacheSource ? `This conversation's KV cache came from: ${SOURCES[state.cacheSource] || state.cacheSource}` : "";
}

function renderPlan(plan) {
  const box = $("devices");
  box.replaceChildren();
  if (!plan) return;
  const summary = el("p", "small", `${plan.n_gpu_layers} layer(s) on the GPU · context ${fmt(plan.n_ctx)} · ` +
    `KV ${plan.type_k} · encoder on ${plan.mmproj_on_gpu ? "GPU" : "CPU"} · ${plan.max_images_in_context} image(s) in context`);
  box.appendChild(summary);
  for (const d of plan.devices) {
    const p = d.predicted;
    const parts = [["weights", p.weights + p.other], ["kv", p.kv], ["compute", p.compute],
                   ["encoder", p.mmproj_weights + p.mmproj_compute]];
    const scale = Math.max(d.budget_bytes, p.total, 1);
    const node = el("div", "device");
    const name = node.appendChild(el("div", "name"));
    name.appendChild(el("span", "", `${d.name} (${d.kind})`));
    name.appendChild(el("span", "", `${mib(p.total)} of ${mib(d.budget_bytes)}`));
    const bar = node.appendChild(el("div", "bar"));
    bar.setAttribute("role", "img");
    bar.setAttribute("aria-label", `${d.name}: ` + parts.map(([k, v]) => `${k} ${mib(v)}`).join(", ") +
      `, headroom ${mib(d.headroom_bytes)}`);
    for (const [k, v] of parts) {
      const s = bar.appendChild(el("span", k));
      s.style.width = `${(100 * v) / scale}%`;
    }
    box.appendChild(node);
  }
}

async function poll() {
  try {
    const resp = await fetch("/status", { headers: authHeaders() });  // (the key, once the page has one)
    if (resp.ok) renderStatus(await resp.json());
  } catch (e) {
    $("server").replaceChildren(el("dt", "", "state"), el("dd", "error", "server unreachable"));
  }
  setTimeout(poll, 1000);
}

async function loadModel() {
  try {
    const resp = await api("/v1/models");
    if (resp.ok) {
      const data = await resp.json();
      state.model = data.data[0].id;
      $("model").textContent = state.model;
    }
  } catch (e) { /* the panel says what is wrong */ }
}

// --- wiring ---------------------------------------------------------------------------------------
$("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("new-chat").addEventListener("click", newConversation);
$("file").addEventListener("change", (e) => { addFiles(e.target.files); e.target.value = ""; });
$("toggle-panel").addEventListener("click", () => {
  const panel = $("panel");
  panel.hidden = !panel.hidden;
  $("toggle-panel").setAttribute("aria-expanded", String(!panel.hidden));
});
const composer = $("composer");
for (const name of ["dragenter", "dragover"]) {
  composer.addEventListener(name, (e) => { e.preventDefault(); composer.classList.add("dragging"); });
}
composer.addEventListener("dragleave", () => composer.classList.remove("dragging"));
composer.addEventListener("drop", (e) => {
  e.preventDefault();
  composer.classList.remove("dragging");
  addFiles(e.dataTransfer.files);
});
document.addEventListener("paste", (e) => {
  const files = [...(e.clipboardData ? e.clipboardData.files : [])];
  if (files.length) { e.preventDefault(); addFiles(files); }
});
loadModel();
poll();
$("input").focus();
