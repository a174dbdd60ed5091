// astrai's chat page: streams each answer from /v1/chat/completions, keeps the conversation in
// this browser (localStorage), stops a reply on request. Plain JavaScript: no build, no CDN.
"use strict";

const STORAGE_KEY = "astrai.chat.messages";
const messagesEl = document.getElementById("messages");
const input = document.getElementById("input");
const sendButton = document.getElementById("send");
const stopButton = document.getElementById("stop");
const statusEl = document.getElementById("status");

let messages = JSON.parse(localStorage.getItem(STORAGE_KEY) || "[]");
let model = null;
let controller = null;

function save() {
  localStorage.setItem(STORAGE_KEY, JSON.stringify(messages));
}

function bubble(message) {
  const el = document.createElement("div");
  el.className = `message ${message.role}` + (message.stopped ? " stopped" : "");
  el.textContent = message.content; // text, never HTML: a reply cannot inject markup
  messagesEl.appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function setBusy(busy) {
  sendButton.hidden = busy;
  stopButton.hidden = !busy;
  input.disabled = busy;
}

async function loadModel() {
  const reply = await fetch("/v1/models");
  if (!reply.ok) {
    statusEl.textContent = `cannot list the models: ${reply.status} ${reply.statusText}`;
    return;
  }
  model = (await reply.json()).data[0].id;
  document.getElementById("model").textContent = model;
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
  const answer = { role: "assistant", content: "" };
  const answerEl = bubble(answer);
  answerEl.classList.add("streaming");
  controller = new AbortController();
  setBusy(true);
  statusEl.textContent = "";
  const start = performance.now();
  let first = null;
  let usage = null;
  try {
    const reply = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({
        model,
        messages: messages.map(({ role, content }) => ({ role, content })),
        stream: true,
        stream_options: { include_usage: true },
      }),
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
        answerEl.textContent = answer.content;
        answerEl.scrollIntoView({ block: "end" });
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
loadModel();
