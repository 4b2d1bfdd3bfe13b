// The Chat page: conversations kept in localStorage (new, rename, delete), each reply
// named with its model, rendered as Markdown, its thinking apart and collapsible, its
// tool calls shown; earlier reasoning goes back as `reasoning_content`; images when the
// model sees them; Stop while streaming, prefill progress and tokens/s.
import { $, apiError, bar, el, renderInto, renderOptions } from "./dom.mjs";
import { renderMarkdown } from "./markdown.mjs";
import {
  foldChatStream,
  hasVision,
  loadConversations,
  newConversation,
  parseSse,
  pendingToolCalls,
  replyStats,
  requestMessages,
  saveConversations,
  servingModels,
  titleFrom,
} from "./view.mjs";

const CURRENT_KEY = "exo-current-conversation";
let conversations = [];
let currentId = null;
let streaming = null; // {abort, conversationId}
let attachments = [];
let renaming = null;
let chatStore = null; // the app's store, for the tool results' forms

function current() {
  return conversations.find((c) => c.id === currentId) ?? null;
}

function save() {
  try {
    saveConversations(window.localStorage, conversations);
  } catch {
    // localStorage full (large images): keep the conversation for this visit only.
  }
  window.localStorage.setItem(CURRENT_KEY, currentId ?? "");
}

function select(id) {
  currentId = id;
  // The conversation's own model again, until the user picks another.
  const picker = $("chat-model");
  delete picker.dataset.touched;
  const wanted = current()?.model;
  if (wanted && [...picker.options].some((option) => option.value === wanted)) picker.value = wanted;
  save();
  renderTranscript();
  renderList();
}

function startNew(store) {
  const conversation = newConversation($("chat-model").value || servingModels(store.state ?? { instances: {} })[0] || "");
  conversations.unshift(conversation);
  select(conversation.id);
  $("chat-input").focus();
}

function renderList() {
  const list = $("conversation-list");
  const key = [conversations.map((c) => [c.id, c.title]), currentId, renaming, Boolean(streaming)];
  renderInto(list, key, () =>
    conversations.map((c) => {
      if (renaming === c.id) {
        const input = el("input", { value: c.title, "aria-label": "conversation name", class: "rename" });
        const finish = (keep) => {
          if (keep && input.value.trim()) c.title = input.value.trim();
          renaming = null;
          save();
          renderList();
        };
        input.addEventListener("keydown", (event) => {
          if (event.key === "Enter") finish(true);
          if (event.key === "Escape") finish(false);
        });
        input.addEventListener("blur", () => finish(true));
        setTimeout(() => input.select(), 0);
        return el("li", { class: "active" }, input);
      }
      return el(
        "li",
        { class: c.id === currentId ? "active" : "", "data-id": c.id },
        el("button", { type: "button", class: "conversation", onclick: () => select(c.id), title: c.title }, c.title),
        el("button", { type: "button", class: "icon", title: "Rename", "aria-label": "Rename", onclick: () => {
          renaming = c.id;
          renderList();
        } }, "✎"),
        el("button", { type: "button", class: "icon", title: "Delete", "aria-label": "Delete", disabled: streaming?.conversationId === c.id, onclick: () => {
          conversations = conversations.filter((other) => other.id !== c.id);
          if (currentId === c.id) currentId = conversations[0]?.id ?? null;
          save();
          renderTranscript();
          renderList();
        } }, "✕"),
      );
    }),
  );
}

function replyParts(message, live) {
  const parts = [el("div", { class: "reply-model" }, message.model || "model")];
  if (live && message.prefill && !message.content && !message.reasoning) {
    const { done, total } = message.prefill;
    parts.push(el("div", { class: "prefill muted" }, `reading the prompt: ${done}/${total} tokens`, bar(total ? done / total : 0)));
  } else if (live && !message.content && !message.reasoning && !message.toolCalls) {
    parts.push(el("div", { class: "muted" }, "waiting for the first token…"));
  }
  if (message.reasoning) {
    parts.push(
      el(
        "details",
        { class: "thinking", open: live && !message.content ? true : null },
        el("summary", {}, live && !message.content ? "Thinking…" : "Thought"),
        el("div", { class: "thinking-text" }, message.reasoning),
      ),
    );
  }
  if (message.content) parts.push(el("div", { class: "content markdown", html: renderMarkdown(message.content) }));
  for (const call of message.toolCalls ?? []) {
    parts.push(el("div", { class: "tool-call" }, el("span", { class: "tool-label" }, "tool call"), el("code", {}, `${call.name}(${call.arguments})`)));
  }
  if (message.error) parts.push(el("div", { class: "error" }, message.error));
  if (message.stats) parts.push(el("div", { class: "stats muted" }, message.stats));
  return parts;
}

function messageView(message, live = false) {
  if (message.role === "tool") {
    return el(
      "div",
      { class: "message tool" },
      el("span", { class: "tool-label" }, "tool result"),
      el("code", {}, `${message.name}: ${message.content}`),
    );
  }
  if (message.role === "user") {
    return el(
      "div",
      { class: "message user" },
      el("div", { class: "content" }, message.content),
      ...(message.images ?? []).map((src) => el("img", { src, alt: "attached image", class: "thumb" })),
    );
  }
  return el("div", { class: live ? "message assistant live" : "message assistant" }, ...replyParts(message, live));
}

function renderTranscript() {
  const conversation = current();
  const box = $("transcript");
  delete box.dataset.key;
  if (!conversation || conversation.messages.length === 0) {
    box.replaceChildren(el("p", { class: "muted empty" }, "Pick a serving model and ask something."));
    return;
  }
  const pending = streaming ? [] : pendingToolCalls(conversation);
  box.replaceChildren(
    ...conversation.messages.map((m, i) => messageView(m, streaming && i === conversation.messages.length - 1)),
    ...pending.map((call) => toolResultForm(conversation, call)),
  );
  box.scrollTop = box.scrollHeight;
}

// The page runs no tool: the user answers each call of the last reply, and once all are
// answered the results go to the model for its next reply.
function toolResultForm(conversation, call) {
  const input = el("input", { name: "result", "aria-label": `result of ${call.function.name}`, placeholder: 'what the tool returned, e.g. {"temperature": 21}' });
  const submit = (event) => {
    event.preventDefault();
    if (streaming || !input.value.trim()) return;
    conversation.messages.push({ role: "tool", toolCallId: call.id, name: call.function.name, content: input.value.trim() });
    save();
    if (pendingToolCalls(conversation).length) renderTranscript();
    else reply(chatStore, conversation, $("chat-model").value || conversation.model);
  };
  return el(
    "form",
    { class: "tool-result", "data-call": call.id, onsubmit: submit },
    el("label", {}, el("span", { class: "tool-label" }, "result of"), el("code", {}, `${call.function.name}(${call.function.arguments})`)),
    el("div", { class: "tool-result-row" }, input, el("button", { type: "submit" }, "Send result")),
  );
}

function updateControls(store) {
  const busy = Boolean(streaming);
  $("stop-button").disabled = !busy;
  $("send-button").disabled = busy;
  const card = store.cards.find((c) => c.model_id === $("chat-model").value);
  const vision = hasVision(card);
  $("attach-label").hidden = !vision;
  if (!vision && attachments.length) {
    attachments = [];
    renderAttachments();
  }
}

function renderAttachments() {
  $("attachments").replaceChildren(
    ...attachments.map((src, i) =>
      el(
        "span",
        { class: "attachment" },
        el("img", { src, alt: "image to send", class: "thumb" }),
        el("button", { type: "button", class: "icon", "aria-label": "Remove image", onclick: () => {
          attachments.splice(i, 1);
          renderAttachments();
        } }, "✕"),
      ),
    ),
  );
}

// The tools box's JSON list; null when empty, undefined (and an error shown) when invalid.
function toolsGiven() {
  const text = $("chat-tools").value.trim();
  $("tools-error").textContent = "";
  if (!text) return null;
  try {
    const tools = JSON.parse(text);
    if (Array.isArray(tools)) return tools;
  } catch {
    // shown below
  }
  $("tools-error").textContent = "Tools must be a JSON list.";
  $("tools-box").open = true;
  return undefined;
}

async function send(store, event) {
  event.preventDefault();
  if (streaming) return;
  const text = $("chat-input").value.trim();
  const model = $("chat-model").value;
  if (!text) return;
  if (!model) {
    $("chat-status").textContent = "No model serves yet: place one on the Models page.";
    return;
  }
  if (toolsGiven() === undefined) return;
  if (!current()) startNew(store);
  const conversation = current();
  if (conversation.messages.length === 0) conversation.title = titleFrom(text);
  conversation.messages.push({ role: "user", content: text, ...(attachments.length ? { images: attachments } : {}) });
  $("chat-input").value = "";
  await reply(store, conversation, model);
}

// Streams the model's reply to the conversation as it stands, with the tools box's tools.
async function reply(store, conversation, model) {
  const tools = toolsGiven();
  if (tools === undefined) return;
  conversation.model = model;
  const body = {
    model,
    messages: requestMessages(conversation),
    stream: true,
    stream_options: { include_usage: true },
    ...(tools ? { tools } : {}),
  };
  const answer = { role: "assistant", model, content: "" };
  conversation.messages.push(answer);
  attachments = [];
  renderAttachments();
  $("chat-status").textContent = "";
  streaming = { abort: new AbortController(), conversationId: conversation.id };
  save();
  renderList();
  renderTranscript();
  updateControls(store);
  const timings = { start: performance.now() };
  let folded = {};
  const show = () => {
    Object.assign(answer, {
      content: folded.content ?? "",
      reasoning: folded.reasoning,
      toolCalls: folded.toolCalls,
      prefill: folded.prefill,
      error: folded.error,
    });
    const live = $("transcript").querySelector(".message.live");
    if (live && currentId === conversation.id) {
      live.replaceChildren(...replyParts(answer, true));
      $("transcript").scrollTop = $("transcript").scrollHeight;
    }
  };
  try {
    const response = await store.api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: streaming.abort.signal,
    });
    if (!response.ok) throw new Error(await apiError(response));
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      const parsed = parseSse(buffer + value);
      buffer = parsed.rest;
      for (const sse of parsed.events) folded = foldChatStream(folded, sse);
      if (!timings.firstToken && (folded.content || folded.reasoning)) timings.firstToken = performance.now();
      show();
    }
  } catch (error) {
    if (error.name === "AbortError") folded = { ...folded, finishReason: "stopped" };
    else folded = { ...folded, error: error.message };
  }
  timings.end = performance.now();
  show();
  delete answer.prefill;
  answer.stats = replyStats(folded, timings);
  streaming = null;
  save();
  renderTranscript();
  renderList();
  updateControls(store);
}

export function renderChat(store) {
  const serving = servingModels(store.state);
  const select = $("chat-model");
  const wanted = current()?.model;
  renderOptions(select, serving);
  if (wanted && serving.includes(wanted) && select.value !== wanted && !select.dataset.touched) select.value = wanted;
  $("chat-model-note").textContent = !serving.length
    ? "No model serves yet: place one on the Models page."
    : wanted && !serving.includes(wanted)
      ? `${wanted} no longer serves: the next reply comes from the model picked here.`
      : "";
  updateControls(store);
}

export function setupChat(store) {
  chatStore = store;
  conversations = loadConversations(window.localStorage);
  const saved = window.localStorage.getItem(CURRENT_KEY);
  currentId = conversations.some((c) => c.id === saved) ? saved : (conversations[0]?.id ?? null);
  $("new-chat").addEventListener("click", () => startNew(store));
  $("chat-form").addEventListener("submit", (event) => send(store, event));
  $("stop-button").addEventListener("click", () => streaming?.abort.abort());
  $("chat-model").addEventListener("change", () => {
    $("chat-model").dataset.touched = "1";
    updateControls(store);
  });
  $("chat-input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("attach-input").addEventListener("change", async () => {
    for (const file of $("attach-input").files) {
      attachments.push(
        await new Promise((resolve) => {
          const reader = new FileReader();
          reader.onload = () => resolve(reader.result);
          reader.readAsDataURL(file);
        }),
      );
    }
    $("attach-input").value = "";
    renderAttachments();
  });
  renderList();
  renderTranscript();
}
