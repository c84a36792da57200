// The page at /: a chat over /v1/chat/completions and a live view of the pipeline (GET /pipeline).
// A client like any other: only the public API. Model output is untrusted: it reaches the page
// as text nodes only (no innerHTML anywhere), so markup in an answer stays text.
"use strict";

const state = {
  key: null,            // the API key, in this page's memory only
  conversations: [],    // {id, title, messages: [{role, content, images, reasoning, stats, error}], controller}
  attached: [],         // data URLs of the images the next message carries (vision models only)
  current: null,
  nextId: 1,
  pollTimer: null,
};

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else if (k === "testid") e.dataset.testid = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

// ---- requests -----------------------------------------------------------------------------------

function headers() {
  const h = { "Content-Type": "application/json" };
  if (state.key) h["Authorization"] = "Bearer " + state.key;
  return h;
}

let keyWaiters = [];

function askForKey(message) {
  $("key-error").textContent = message || "";
  $("key-prompt").classList.remove("hidden");
  $("key-input").focus();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  state.key = $("key-input").value;
  $("key-input").value = "";
  $("key-prompt").classList.add("hidden");
  const waiting = keyWaiters;
  keyWaiters = [];
  waiting.forEach((r) => r());
});

// fetch, asking for the key (again) while the server answers 401
async function call(path, init) {
  for (;;) {
    const r = await fetch(path, { ...init, headers: headers() });
    if (r.status !== 401) return r;
    await askForKey(state.key ? "That key was refused; try another." : "");
  }
}

// ---- Markdown, safely: code fences, inline code, bold; every piece of text a text node ----------

function inline(parent, text) {
  const re = /(`[^`\n]+`|\*\*[^*\n]+\*\*)/g;
  let last = 0;
  for (const m of text.matchAll(re)) {
    if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
    const t = m[0];
    parent.append(t.startsWith("`") ? el("code", {}, t.slice(1, -1)) : el("strong", {}, t.slice(2, -2)));
    last = m.index + t.length;
  }
  if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
}

function renderMarkdown(parent, text) {
  parent.replaceChildren();
  const parts = text.split(/^```/m);
  parts.forEach((part, i) => {
    if (i % 2 === 1) {  // inside a fence: the first line names the language
      const nl = part.indexOf("\n");
      const code = nl < 0 ? "" : part.slice(nl + 1);
      parent.append(el("pre", {}, el("code", {}, code.replace(/\n$/, ""))));
      return;
    }
    for (const para of part.split(/\n{2,}/)) {
      if (!para.trim()) continue;
      const p = el("p");
      inline(p, para);
      parent.append(p);
    }
  });
}

// ---- chat ---------------------------------------------------------------------------------------

function newConversation() {
  const c = { id: state.nextId++, title: "New chat", messages: [], controller: null };
  state.conversations.unshift(c);
  state.current = c;
  render();
  $("prompt").focus();
  return c;
}

function renderList() {
  const ul = $("conversations");
  ul.replaceChildren(...state.conversations.map((c) => {
    const li = el("li", { class: (c === state.current ? "active " : "") + (c.controller ? "streaming" : ""),
                          testid: "conversation" }, c.title);
    li.addEventListener("click", () => { state.current = c; render(); });
    return li;
  }));
}

function renderMessage(m) {
  const box = el("div", { class: "msg " + m.role, testid: "msg-" + m.role });
  box.append(el("div", { class: "role" }, m.role));
  for (const url of m.images || []) box.append(el("img", { class: "thumb", src: url, alt: "image", testid: "msg-image" }));
  if (m.reasoning) box.append(el("div", { class: "reasoning", testid: "reasoning" }, m.reasoning));
  const content = el("div", { class: "content", testid: "content" });
  renderMarkdown(content, m.content || "");
  box.append(content);
  if (m.error) box.append(el("div", { class: "error", testid: "error" }, m.error));
  if (m.stats) box.append(el("div", { class: "stats", testid: "stats" }, m.stats));
  return box;
}

function render() {
  renderList();
  const c = state.current;
  const box = $("messages");
  box.replaceChildren(...(c ? c.messages.map(renderMessage) : []));
  box.scrollTop = box.scrollHeight;
  const busy = !!(c && c.controller);
  $("stop").disabled = !busy;
  $("send").disabled = busy;
  $("regenerate").disabled = busy || !c || !c.messages.some((m) => m.role === "assistant");
}

function settings() {
  const num = (id) => { const v = parseFloat($(id).value); return Number.isFinite(v) ? v : undefined; };
  return { temperature: num("set-temperature"), top_k: num("set-top_k"), top_p: num("set-top_p"),
           min_p: num("set-min_p"), max_tokens: num("set-max_tokens") };
}

function statsOf(timings, usage) {
  const parts = [];
  if (timings) {
    parts.push(`${timings.predicted_n} tokens, ${timings.predicted_per_second.toFixed(1)} tokens/s`);
    parts.push(`prompt ${timings.prompt_n} evaluated, ${timings.cache_n} cached`);
  } else if (usage) {
    parts.push(`${usage.completion_tokens} tokens`);
  }
  if (usage && usage.prompt_tokens_details) parts.push(`cached prompt tokens: ${usage.prompt_tokens_details.cached_tokens}`);
  return parts.join(" · ");
}

async function complete(c) {
  const system = $("set-system").value.trim();
  const history = c.messages.filter((m) => !m.error || m.content).map((m) => ({
    role: m.role,
    content: m.images && m.images.length
      ? [...m.images.map((url) => ({ type: "image_url", image_url: { url } })), { type: "text", text: m.content }]
      : m.content,
  }));
  const body = { model: "default", stream: true, stream_options: { include_usage: true }, ...settings(),
                 messages: system ? [{ role: "system", content: system }, ...history] : history };
  const answer = { role: "assistant", content: "", reasoning: "", stats: "" };
  c.messages.push(answer);
  c.controller = new AbortController();
  render();
  let timings = null, usage = null;
  try {
    const r = await call("/v1/chat/completions", { method: "POST", body: JSON.stringify(body), signal: c.controller.signal });
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data: ") || line === "data: [DONE]") continue;
          const chunk = JSON.parse(line.slice(6));
          if (chunk.error) throw new Error(chunk.error.message);
          const d = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
          if (d && d.content) answer.content += d.content;
          if (d && d.reasoning_content) answer.reasoning += d.reasoning_content;
          if (chunk.timings) timings = chunk.timings;
          if (chunk.usage) usage = chunk.usage;
        }
      }
      if (c === state.current) render();
    }
    answer.stats = statsOf(timings, usage);
  } catch (e) {
    if (e.name === "AbortError") answer.stats = "stopped";
    else answer.error = String(e.message || e);
  } finally {
    c.controller = null;
    render();
  }
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value;
  if (!text.trim()) return;
  const c = state.current || newConversation();
  if (c.controller) return;
  if (!c.messages.length) c.title = text.slice(0, 40);
  c.messages.push({ role: "user", content: text, images: state.attached });
  state.attached = [];
  renderAttached();
  $("prompt").value = "";
  complete(c);
});

// ---- images: read in the page as data URLs, sent inline with the next message ---------------------

function renderAttached() {
  $("attached").replaceChildren(...state.attached.map((url) => el("img", { src: url, alt: "attached image" })));
}

$("attach-input").addEventListener("change", async (ev) => {
  for (const f of ev.target.files) {
    const url = await new Promise((resolve, reject) => {
      const fr = new FileReader();
      fr.onload = () => resolve(fr.result);
      fr.onerror = () => reject(fr.error);
      fr.readAsDataURL(f);
    });
    state.attached.push(url);
  }
  ev.target.value = "";
  renderAttached();
});

$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});

$("stop").addEventListener("click", () => { if (state.current && state.current.controller) state.current.controller.abort(); });

$("regenerate").addEventListener("click", () => {
  const c = state.current;
  if (!c || c.controller) return;
  while (c.messages.length && c.messages[c.messages.length - 1].role === "assistant") c.messages.pop();
  if (c.messages.length) complete(c);
});

$("new-chat").addEventListener("click", newConversation);

// ---- the pipeline view --------------------------------------------------------------------------

function pct(x) { return x === null || x === undefined ? "–" : Math.round(100 * x) + " %"; }

function bar(x) {
  const fill = el("div");
  fill.style.width = Math.round(100 * (x || 0)) + "%";  // CSSOM: the page's CSP refuses style attributes
  return el("div", { class: "bar" }, fill);
}

function renderPipeline(data) {
  const total = data.replicas.reduce((s, r) => s + r.tokens_per_second, 0);
  $("pipeline-summary").replaceChildren(
    el("div", { class: "figures" },
      el("span", {}, el("b", { testid: "tps" }, total.toFixed(1)), " tokens/s (last minute)"),
      el("span", {}, el("b", {}, String(data.replicas.length)), " engine replica" + (data.replicas.length === 1 ? "" : "s")),
      el("span", {}, "topology ", el("b", { testid: "topology" }, data.topology.topology), " — " + data.topology.reason)));
  const mib = (n) => `${(n / 1048576).toFixed(1)} MiB`;
  // a group's prompt cache: what it holds on each stage's device, and its counters since start
  const cacheLine = (c) => el("div", { class: "muted", testid: "prompt-cache" },
    `prompt cache: ${c.entries}/${c.capacity} entries, ${c.tokens} tokens` +
    (Object.keys(c.bytes).length ? ` (${Object.entries(c.bytes).map(([d, n]) => `${mib(n)} on ${d}`).join(", ")})` : "") +
    `; ${c.hits} hits, ${c.misses} misses, ${c.reused_tokens} tokens reused; ` +
    `${c.invalidations.evicted} evicted, ${c.invalidations.superseded} superseded`);
  $("pipeline-replicas").replaceChildren(...data.replicas.map((r) => {
    const ttft = r.ttft_s.median === null ? "–" : `${r.ttft_s.median.toFixed(2)} s median, ${r.ttft_s.p99.toFixed(2)} s p99`;
    const stages = el("div", { class: "stages" }, ...r.stages.map((s) => el("div", { class: "stage", testid: "stage-" + s.stage },
      el("div", {}, el("b", {}, s.stage === "peer" ? "peer stage (RPC)" : "local stage"), " ", el("span", { class: "muted" }, s.where)),
      el("div", {}, "busy ", pct(s.busy), s.up ? "" : " — down"), bar(s.busy),
      el("div", { class: "muted", testid: "gpu-" + s.stage }, s.gpu_busy
        ? Object.entries(s.gpu_busy).map(([g, v]) => `GPU ${g} busy ${pct(v)}`).join(", ")
        : "CPU node: no GPU busy figure"))));
    const groups = el("div", { class: "groups" }, ...r.groups.map((g) => {
      const busy = g.slots.filter((s) => s.state !== "idle").length;
      return el("div", { class: "group", testid: "group", "data-busy": String(busy) },
        el("div", {}, el("b", {}, "group " + g.group), ` ${busy}/${g.slots.length} slots busy`),
        el("div", { class: "slots" }, ...g.slots.map((s) => el("div", { class: "slot " + s.state, testid: "slot", "data-state": s.state },
          `#${s.id} ${s.state}`, el("br"), `${s.cached_tokens} cached`, s.task ? el("br") : "", s.task ? String(s.task).slice(0, 14) : ""))),
        g.prompt_cache && g.prompt_cache.capacity ? cacheLine(g.prompt_cache) : "");
    }));
    return el("div", { class: "replica", testid: "replica" },
      el("div", {}, el("b", {}, "replica " + r.replica), " ", el("span", { class: "muted" }, r.model)),
      el("div", { class: "figures" }, el("span", {}, r.tokens_per_second.toFixed(1) + " tokens/s"),
        el("span", {}, "TTFT " + ttft), el("span", {}, `${r.running} running, ${r.waiting} waiting`)),
      stages, groups);
  }));
}

async function poll() {
  try {
    const r = await call("/pipeline", {});
    if (r.ok) renderPipeline(await r.json());
  } catch (e) { /* the next poll tries again */ }
}

function show(view) {
  const pipeline = view === "pipeline";
  $("view-chat").classList.toggle("hidden", pipeline);
  $("view-pipeline").classList.toggle("hidden", !pipeline);
  $("tab-chat").classList.toggle("active", !pipeline);
  $("tab-pipeline").classList.toggle("active", pipeline);
  clearInterval(state.pollTimer);
  state.pollTimer = null;
  if (pipeline) { poll(); state.pollTimer = setInterval(() => { if (!document.hidden) poll(); }, 1000); }
}

$("tab-chat").addEventListener("click", () => show("chat"));
$("tab-pipeline").addEventListener("click", () => show("pipeline"));

(async function start() {
  try {
    const r = await call("/v1/models", {});
    if (r.ok) {
      const m = (await r.json()).data[0];
      $("model").textContent = m.id;
      // the attach button where the model takes images (a projector is served)
      if ((m.modalities || []).includes("vision")) $("attach").classList.remove("hidden");
    }
  } catch (e) { /* shown when a chat fails */ }
  if (location.hash === "#pipeline") show("pipeline");
  render();
})();
