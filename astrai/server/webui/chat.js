// astrai's chat page: streams each answer from /v1/chat/completions to the model picked from
// /v1/models, shows answers as Markdown with highlighted code, keeps the conversation, the model
// and the settings in this browser (localStorage), stops a reply on request. Behind an API key
// (astrai serve --api-key) the page itself is public, as llama-server's is: when the API answers
// 401 it asks for the key, keeps it in localStorage and sends it as `Authorization: Bearer` on
// every API call. Plain JavaScript and two vendored libraries (vendor/: marked, highlight.js):
// no build, no CDN.
"use strict";

const STORAGE_KEY = "astrai.chat.messages";
const MODEL_KEY = "astrai.chat.model";
const SETTINGS_KEY = "astrai.chat.settings";
const API_KEY = "astrai.apiKey";
const messagesEl = document.getElementById("messages");
const input = document.getElementById("input");
const modelPicker = document.getElementById("model");
const sendButton = document.getElementById("send");
const stopButton = document.getElementById("stop");
const statusEl = document.getElementById("status");
const keyDialog = document.getElementById("key-dialog");
const keyInput = document.getElementById("api-key");
const keyMessage = document.getElementById("key-message");
const settingFields = {
  system: document.getElementById("system"),
  temperature: document.getElementById("temperature"),
  maxTokens: document.getElementById("max-tokens"),
};

let messages = JSON.parse(localStorage.getItem(STORAGE_KEY) || "[]");
let controller = null;

function save() {
  localStorage.setItem(STORAGE_KEY, JSON.stringify(messages));
}

function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
}

// Links a reply may carry: web and mail addresses, never javascript: or data: URLs.
const SAFE_URL = /^(https?:|mailto:)/i;

// Markdown whose HTML holds no markup the model wrote: raw HTML is shown as text, links go only
// to SAFE_URL addresses (in a new tab), images become links (the browser fetches nothing a reply
// names), code blocks are highlighted (highlight.js escapes the code it marks up).
const markdown = new marked.Marked({
  gfm: true,
  renderer: {
    html: ({ text }) => escapeHtml(text),
    link({ href, tokens }) {
      const label = this.parser.parseInline(tokens);
      if (!SAFE_URL.test(href)) return label;
      return `<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">${label}</a>`;
    },
    image({ href, text }) {
      if (!SAFE_URL.test(href)) return escapeHtml(text);
      return `<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">` +
        `${escapeHtml(text || href)}</a>`;
    },
    code({ text, lang }) {
      const language = (lang || "").split(/\s/)[0];
      const highlighted = hljs.getLanguage(language)
        ? hljs.highlight(text, { language, ignoreIllegals: true })
        : hljs.highlightAuto(text);
      const name = escapeHtml(highlighted.language || "plaintext");
      return `<pre><code class="hljs language-${name}">${highlighted.value}</code></pre>\n`;
    },
  },
});

function show(el, message) {
  if (message.role === "assistant") el.innerHTML = markdown.parse(message.content);
  else el.textContent = message.content; // what the user typed is shown as typed
}

function bubble(message) {
  const el = document.createElement("div");
  el.className = `message ${message.role}` + (message.stopped ? " stopped" : "");
  show(el, message);
  if (message.model) el.dataset.model = message.model;
  messagesEl.appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function setBusy(busy) {
  sendButton.hidden = busy;
  stopButton.hidden = !busy;
  input.disabled = busy;
}

// fetch() of an API route with the kept key; a 401 opens the key dialog with the server's reason.
async function api(path, options = {}) {
  const key = localStorage.getItem(API_KEY);
  const headers = { ...options.headers, ...(key ? { Authorization: `Bearer ${key}` } : {}) };
  const reply = await fetch(path, { ...options, headers });
  if (reply.status === 401) {
    const body = await reply.clone().json().catch(() => ({}));
    askForKey(key, body.error?.message || reply.statusText);
  }
  return reply;
}

function askForKey(refusedKey, reason) {
  keyMessage.textContent = refusedKey
    ? `The server refused this key (${reason}). Enter the key it was started with.`
    : "This server needs an API key (astrai serve --api-key): enter it to chat.";
  keyInput.value = "";
  if (!keyDialog.open) keyDialog.showModal();
  keyInput.focus();
}

// A key entered is kept, and checked at once by listing the models with it.
document.getElementById("key-form").addEventListener("submit", () => {
  localStorage.setItem(API_KEY, keyInput.value);
  statusEl.textContent = "";
  loadModels();
});

// The picker lists every model the server serves (a router loads one when it is first asked);
// the choice is remembered, and falls back to the first model when it is served no more.
async function loadModels() {
  const reply = await api("/v1/models");
  if (!reply.ok) {
    statusEl.textContent = `cannot list the models: ${reply.status} ${reply.statusText}`;
    return;
  }
  const cards = (await reply.json()).data;
  modelPicker.replaceChildren(
    ...cards.map((card) => {
      const option = new Option(card.id, card.id);
      if (card.status?.value === "unloaded") option.title = "loads on its first message";
      return option;
    }),
  );
  const remembered = localStorage.getItem(MODEL_KEY);
  if (cards.some((card) => card.id === remembered)) modelPicker.value = remembered;
}

modelPicker.addEventListener("change", () => localStorage.setItem(MODEL_KEY, modelPicker.value));

function loadSettings() {
  const stored = JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}");
  for (const [name, field] of Object.entries(settingFields)) {
    field.value = stored[name] ?? "";
    field.addEventListener("change", saveSettings);
  }
}

function saveSettings() {
  const values = Object.fromEntries(
    Object.entries(settingFields).map(([name, field]) => [name, field.value]),
  );
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(values));
}

// The request's messages and sampling from the settings; a field left empty is left out, so the
// server's default (the model's generation_config) applies.
function chatRequest() {
  const system = settingFields.system.value.trim();
  const conversation = messages.map(({ role, content }) => ({ role, content }));
  const request = {
    model: modelPicker.value,
    messages: system ? [{ role: "system", content: system }, ...conversation] : conversation,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (settingFields.temperature.value !== "") {
    request.temperature = Number(settingFields.temperature.value);
  }
  if (settingFields.maxTokens.value !== "") {
    request.max_tokens = Number(settingFields.maxTokens.value);
  }
  return request;
}

// The events of an SSE body, each `data: ...` payload once it is complete.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    const events = buffer.split("\n\n");
    buffer = events.pop();
    for (const event of events) {
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

async function send(text) {
  messages.push({ role: "user", content: text });
  save();
  bubble(messages[messages.length - 1]);
  const answer = { role: "assistant", content: "", model: modelPicker.value };
  const answerEl = bubble(answer);
  let rendering = false;
  answerEl.classList.add("streaming");
  controller = new AbortController();
  setBusy(true);
  statusEl.textContent = "";
  const start = performance.now();
  let first = null;
  let usage = null;
  try {
    const reply = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(chatRequest()),
      signal: controller.signal,
    });
    if (!reply.ok) {
      const body = await reply.json().catch(() => ({}));
      throw new Error(body.error?.message || `${reply.status} ${reply.statusText}`);
    }
    for await (const data of sseData(reply.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        first ??= performance.now();
        answer.content += delta;
        if (!rendering) {
          // One Markdown render a frame, not one a token: a long answer stays cheap to stream.
          rendering = true;
          requestAnimationFrame(() => {
            rendering = false;
            show(answerEl, answer);
            answerEl.scrollIntoView({ block: "end" });
          });
        }
      }
    }
    const end = performance.now();
    if (usage && first !== null && usage.completion_tokens > 1 && end > first) {
      // Tokens after the first over the time from the first to the last: the decode rate.
      const rate = (usage.completion_tokens - 1) / ((end - first) / 1000);
      statusEl.textContent = `${usage.completion_tokens} tokens, ${rate.toFixed(1)} tokens/s; ` +
        `first token after ${((first - start) / 1000).toFixed(2)} s`;
    }
  } catch (error) {
    if (error.name === "AbortError") {
      answer.stopped = true; // kept as far as it came, marked as cut short
      answerEl.classList.add("stopped");
      statusEl.textContent = "stopped";
    } else {
      statusEl.textContent = `error: ${error.message}`;
    }
  } finally {
    show(answerEl, answer);
    answerEl.classList.remove("streaming");
    controller = null;
    setBusy(false);
    input.focus();
  }
  messages.push(answer);
  save();
}

document.getElementById("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  const text = input.value.trim();
  if (!text || controller) return;
  input.value = "";
  send(text);
});

input.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) {
    event.preventDefault();
    document.getElementById("composer").requestSubmit();
  }
});

stopButton.addEventListener("click", () => controller?.abort());

document.getElementById("new-chat").addEventListener("click", () => {
  messages = [];
  save();
  messagesEl.replaceChildren();
  statusEl.textContent = "";
});

messages.forEach(bubble);
loadSettings();
loadModels();
