// The dashboard's DOM side: polls this node's API and draws what view.mjs computes.
import {
  downloadRows,
  foldChatStream,
  formatBytes,
  instanceRows,
  keyedFetch,
  linkRows,
  nodeName,
  nodeRows,
  parseSse,
  previewRows,
  servingModels,
  shortId,
  topologyLayout,
} from "./view.mjs";

const $ = (id) => document.getElementById(id);
// Every call to the API carries the key the node asked for (--api-key), if it asks.
const api = keyedFetch(window.fetch.bind(window), window.localStorage, (refused) =>
  window.prompt(refused ? "That API key was refused. The exo API key:" : "This exo node needs its API key:"),
);
let state = null;
let models = [];
const history = [];
let chatAbort = null;

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child);
  }
  return node;
}

function bar(fraction) {
  const fill = el("div", { class: "fill" });
  fill.style.width = `${Math.round(100 * Math.min(Math.max(fraction, 0), 1))}%`;
  return el("div", { class: "bar" }, fill);
}

// The API answers errors in OpenAI's shape: {"error": {"message": ...}}.
async function apiError(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

function renderTopology() {
  const { size, nodes, edges } = topologyLayout(state);
  const parts = [];
  for (const edge of edges) {
    // A link seen one way only cannot carry an MLX ring: dashed.
    parts.push(svg("line", { ...edge, class: edge.bothWays ? "link" : "link one-way" }));
    if (edge.label) {
      parts.push(svg("text", { x: (edge.x1 + edge.x2) / 2, y: (edge.y1 + edge.y2) / 2 - 4, class: "link-label" }, edge.label));
    }
  }
  for (const node of nodes) {
    parts.push(svg("circle", { cx: node.x, cy: node.y, r: 22, class: node.isMaster ? "node master" : "node" }));
    parts.push(svg("text", { x: node.x, y: node.y + 38, class: "node-label" }, node.name));
    parts.push(svg("text", { x: node.x, y: node.y + 4, class: "node-memory" }, `${node.memoryPercent}%`));
  }
  $("topology").setAttribute("viewBox", `0 0 ${size} ${size}`);
  $("topology").replaceChildren(...parts);
}

function renderNodes() {
  renderTopology();
  $("nodes").replaceChildren(
    ...nodeRows(state).map((node) =>
      el(
        "div",
        { class: "card" },
        el("div", { class: "title" }, node.name, node.isMaster ? el("span", { class: "badge" }, "master") : null),
        el("div", { class: "muted" }, `${shortId(node.nodeId)} · ${node.backend} · ${node.cpuCount} CPUs`),
        el("div", {}, `memory ${formatBytes(node.memoryUsed)} of ${formatBytes(node.memoryTotal)}`),
        bar(node.memoryPercent / 100),
        el("div", { class: "muted" }, `disk free ${formatBytes(node.diskAvailable)}`),
      ),
    ),
  );
  const fmt = (value, unit) => (value === null || value === undefined ? "measuring…" : `${value.toFixed(1)} ${unit}`);
  const links = linkRows(state);
  $("links").tBodies[0].replaceChildren(
    ...(links.length === 0 ? [el("tr", {}, el("td", { colspan: "5", class: "muted" }, "No links measured yet."))] : []),
    ...links.map((link) =>
      el(
        "tr",
        {},
        el("td", {}, link.from),
        el("td", {}, link.to),
        el("td", {}, link.ip),
        el("td", {}, fmt(link.latencyMs, "ms")),
        el("td", {}, fmt(link.bandwidthMbps, "Mbit/s")),
      ),
    ),
  );
}

async function deleteInstance(instanceId) {
  const response = await api(`/instance/${instanceId}`, { method: "DELETE" });
  if (!response.ok) $("place-message").textContent = await apiError(response);
}

function renderInstances() {
  const rows = instanceRows(state);
  // The most recent few removals, with why: a failed instance explains itself here.
  const deleted = Object.entries(state.instanceDeletions ?? {}).slice(-3);
  $("instances").replaceChildren(
    ...(rows.length === 0 ? [el("p", { class: "muted" }, "No model is placed yet.")] : []),
    ...rows.map((instance) =>
      el(
        "div",
        { class: "card wide" },
        el(
          "div",
          { class: "title" },
          instance.modelId,
          el("span", { class: instance.serving ? "badge ok" : "badge" }, instance.serving ? "serving" : "starting"),
          el("button", { class: "small", onclick: () => deleteInstance(instance.instanceId) }, "Delete"),
        ),
        el(
          "div",
          { class: "muted" },
          `${instance.sharding} · ${instance.ranks.length} rank(s) · ${instance.activeRequests} active request(s)`,
        ),
        ...instance.ranks.map((rank) =>
          el(
            "div",
            { class: rank.status.failed ? "rank failed" : "rank" },
            `rank ${rank.rank} on ${rank.node}, layers ${rank.layers}: ${rank.status.text}`,
            rank.status.progress !== null ? bar(rank.status.progress) : null,
          ),
        ),
      ),
    ),
    ...deleted.map(([instanceId, reason]) =>
      el("p", { class: "muted" }, `Instance ${shortId(instanceId)} was removed: ${reason}`),
    ),
  );
  $("downloads").replaceChildren(
    ...downloadRows(state).map((row) =>
      el(
        "div",
        { class: "rank" },
        `${row.modelId} on ${row.node}: ${row.text}`,
        row.fraction !== null ? bar(row.fraction) : null,
      ),
    ),
  );
}

function fillSelect(select, values) {
  const current = select.value;
  if ([...select.options].map((o) => o.value).join() === values.join()) return;
  select.replaceChildren(...values.map((value) => el("option", { value }, value)));
  if (values.includes(current)) select.value = current;
}

function render() {
  const master = state.masterNodeId ? nodeName(state, state.masterNodeId) : "none";
  $("cluster-summary").textContent =
    `${Object.keys(state.nodes).length} node(s) · master ${master} · event ${state.lastEventAppliedIdx}`;
  renderNodes();
  renderInstances();
  fillSelect($("chat-model"), servingModels(state));
}

async function poll() {
  try {
    const response = await api("/state");
    if (!response.ok) throw new Error(await apiError(response));
    state = await response.json();
    $("connection").textContent = "online";
    $("connection").className = "badge ok";
    render();
  } catch {
    $("connection").textContent = "offline";
    $("connection").className = "badge bad";
  }
  setTimeout(poll, 1000);
}

async function loadModels() {
  const response = await api("/v1/models");
  if (response.ok) {
    models = (await response.json()).data;
    fillSelect(
      $("place-model"),
      models.map((m) => m.id),
    );
  }
}

function placementQuery() {
  return {
    model_id: $("place-model").value,
    sharding: $("place-sharding").value,
    min_nodes: Number($("place-min-nodes").value) || 1,
  };
}

async function showPreviews() {
  const query = new URLSearchParams(placementQuery());
  const response = await api(`/instance/previews?${query}`);
  if (!response.ok) {
    $("place-message").textContent = await apiError(response);
    return;
  }
  const table = $("previews");
  table.hidden = false;
  table.tBodies[0].replaceChildren(
    ...previewRows(state, await response.json()).map((row) =>
      el(
        "tr",
        { class: row.fits ? "" : "rejected" },
        el("td", {}, row.nodes),
        el("td", {}, row.sharding),
        el("td", {}, row.memory),
        el("td", {}, row.verdict),
      ),
    ),
  );
}

async function place(event) {
  event.preventDefault();
  const response = await api("/place_instance", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(placementQuery()),
  });
  $("place-message").textContent = response.ok ? (await response.json()).message : await apiError(response);
}

async function addFromHub(event) {
  event.preventDefault();
  const modelId = $("add-model").value.trim();
  $("place-message").textContent = `reading ${modelId} from the hub…`;
  const response = await api("/models/add", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({ model_id: modelId }),
  });
  if (!response.ok) {
    $("place-message").textContent = await apiError(response);
    return;
  }
  const card = await response.json();
  $("place-message").textContent = `added ${card.model_id}: ${card.n_layers} layers, ${formatBytes(card.storage_size.in_bytes)}`;
  // The card reaches this node's State a moment after the command; wait to select it.
  for (let tries = 0; tries < 20 && !models.some((m) => m.id === card.model_id); tries += 1) {
    await new Promise((resolve) => setTimeout(resolve, 250));
    await loadModels();
  }
  $("place-model").value = card.model_id;
}

function renderReply(box, reply) {
  const parts = [];
  if (reply.prefill && !reply.content && !reply.reasoning) {
    parts.push(el("div", { class: "muted" }, `reading the prompt: ${reply.prefill.done}/${reply.prefill.total} tokens`));
  }
  if (reply.reasoning) parts.push(el("details", {}, el("summary", {}, "thinking"), el("pre", {}, reply.reasoning)));
  if (reply.content) parts.push(el("div", { class: "content" }, reply.content));
  for (const call of reply.toolCalls ?? []) parts.push(el("pre", { class: "tool" }, `${call.name}(${call.arguments})`));
  if (reply.error) parts.push(el("div", { class: "error" }, reply.error));
  box.replaceChildren(...parts);
}

async function sendChat(event) {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  const model = $("chat-model").value;
  if (!text) return;
  if (!model) {
    $("chat-stats").textContent = "Place a model first: the chat talks to a serving instance.";
    return;
  }
  history.push({ role: "user", content: text });
  $("chat-input").value = "";
  $("transcript").append(el("div", { class: "message user" }, text));
  const box = el("div", { class: "message assistant" });
  $("transcript").append(box);

  chatAbort = new AbortController();
  $("stop-button").disabled = false;
  $("send-button").disabled = true;
  const started = performance.now();
  let firstToken = null;
  let reply = {};
  try {
    const response = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model, messages: history, stream: true, stream_options: { include_usage: true } }),
      signal: chatAbort.signal,
    });
    if (!response.ok) throw new Error(await apiError(response));
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      const parsed = parseSse(buffer + value);
      buffer = parsed.rest;
      for (const sse of parsed.events) reply = foldChatStream(reply, sse);
      if (firstToken === null && (reply.content || reply.reasoning)) firstToken = performance.now();
      renderReply(box, reply);
      $("transcript").scrollTop = $("transcript").scrollHeight;
    }
  } catch (error) {
    if (error.name !== "AbortError") reply = { ...reply, error: error.message };
    renderReply(box, reply);
  } finally {
    chatAbort = null;
    $("stop-button").disabled = true;
    $("send-button").disabled = false;
  }
  if (reply.content) history.push({ role: "assistant", content: reply.content });
  const stats = reply.stats;
  $("chat-stats").textContent = stats
    ? `${stats.prompt_tokens} prompt tokens at ${stats.prompt_tps.toFixed(1)} tokens/s, ` +
      `${stats.generation_tokens} generated at ${stats.generation_tps.toFixed(1)} tokens/s, ` +
      `first token after ${((firstToken ?? started) - started).toFixed(0)} ms, ${reply.finishReason ?? "stopped"}`
    : "";
}

$("preview-button").addEventListener("click", showPreviews);
$("place-form").addEventListener("submit", place);
$("add-form").addEventListener("submit", addFromHub);
$("chat-form").addEventListener("submit", sendChat);
$("stop-button").addEventListener("click", () => chatAbort?.abort());
$("chat-input").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) $("chat-form").requestSubmit();
});
poll();
loadModels();
setInterval(loadModels, 15000);
