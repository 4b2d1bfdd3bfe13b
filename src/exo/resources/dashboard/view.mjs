// What the dashboard shows, computed from the node's /state and /v1/models JSON.
// Pure functions with no DOM, so Node can run them in the tests on a real node's data.

export function shortId(id) {
  return id ? id.slice(0, 8) : "-";
}

export function formatBytes(bytes) {
  if (bytes === null || bytes === undefined) return "-";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${value.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}

// A node's friendly name, with its short id when another node has the same name (two
// nodes on one machine, or two laptops both called "MacBook Pro").
export function nodeName(state, nodeId) {
  const info = state.nodes[nodeId];
  if (!info) return shortId(nodeId);
  const namesakes = Object.values(state.nodes).filter((other) => other.friendlyName === info.friendlyName);
  return namesakes.length > 1 ? `${info.friendlyName} (${shortId(nodeId)})` : info.friendlyName;
}

// "mlx" or "llamacpp" (NodeInfo's and Instance's `engine`; MLX where State has none).
export function engineName(engine) {
  return engine === "llamacpp" ? "llama.cpp" : "MLX";
}

// A GPU's memory as a node row shows it (NodeInfo's `gpus`: an NVIDIA node's, from nvidia-smi).
function gpuRow(gpu) {
  const used = gpu.totalBytes - gpu.freeBytes;
  return { name: gpu.name, used, total: gpu.totalBytes, percent: gpu.totalBytes > 0 ? Math.round((100 * used) / gpu.totalBytes) : 0 };
}

// One row per node: who it is, whether it is the master, and how full its memory (and
// its GPUs' memory) is.
export function nodeRows(state) {
  return Object.values(state.nodes)
    .map((info) => {
      const total = info.memory.totalBytes;
      const used = total - info.memory.availableBytes;
      return {
        nodeId: info.nodeId,
        name: nodeName(state, info.nodeId),
        isMaster: info.nodeId === state.masterNodeId,
        backend: info.backend,
        engine: `${engineName(info.engine)} ${info.backend}`,
        os: info.os,
        cpuCount: info.cpuCount,
        memoryUsed: used,
        memoryTotal: total,
        memoryPercent: total > 0 ? Math.round((100 * used) / total) : 0,
        gpus: (info.gpus ?? []).map(gpuRow),
        diskAvailable: info.diskAvailableBytes,
        apiPort: info.apiPort,
      };
    })
    .sort((a, b) => Number(b.isMaster) - Number(a.isMaster) || a.name.localeCompare(b.name));
}

export function linkRows(state) {
  return state.topology.connections.map((link) => ({
    from: nodeName(state, link.source),
    to: nodeName(state, link.sink),
    ip: link.sinkIp,
    latencyMs: link.latencyMs,
    bandwidthMbps: link.bandwidthMbps,
  }));
}

// A runner's status as one line of text and, while it loads, a fraction done.
export function describeRunner(status) {
  if (!status) return { text: "pending", progress: null, failed: false };
  const text = status.kind.replace(/^Runner/, "");
  if (status.kind === "RunnerLoading" && status.totalConvertBytes > 0) {
    const percent = Math.floor((100 * status.convertedBytes) / status.totalConvertBytes);
    return {
      text: `Converting the weights for the engine: ${percent}%`,
      progress: status.convertedBytes / status.totalConvertBytes,
      failed: false,
    };
  }
  if (status.kind === "RunnerLoading" && status.totalLayers > 0) {
    return {
      text: `Loading ${status.layersLoaded}/${status.totalLayers} layers`,
      progress: status.layersLoaded / status.totalLayers,
      failed: false,
    };
  }
  if (status.kind === "RunnerFailed") {
    return { text: `Failed (attempt ${status.attempt}): ${status.errorMessage}`, progress: null, failed: true };
  }
  if (status.kind === "RunnerRunning") {
    return { text: `Running ${status.activeTasks} request(s)${status.queuedTasks ? `, ${status.queuedTasks} queued` : ""}`, progress: null, failed: false };
  }
  return { text, progress: null, failed: false };
}

const SERVING = new Set(["RunnerReady", "RunnerRunning"]);

// One row per instance, with each rank's node, layers and runner status.
export function instanceRows(state) {
  return Object.values(state.instances).map((instance) => {
    const assignments = instance.shardAssignments;
    const nodeOfRunner = Object.fromEntries(
      Object.entries(assignments.nodeToRunner).map(([nodeId, runnerId]) => [runnerId, nodeId]),
    );
    const ranks = Object.entries(assignments.runnerToShard)
      .map(([runnerId, shard]) => ({
        rank: shard.deviceRank,
        node: nodeName(state, nodeOfRunner[runnerId]),
        layers: `${shard.startLayer}-${shard.endLayer - 1} of ${shard.nLayers}`,
        status: describeRunner(state.runners[runnerId]),
        serving: SERVING.has(state.runners[runnerId]?.kind),
      }))
      .sort((a, b) => a.rank - b.rank);
    const tasks = Object.values(state.tasks).filter((t) => t.instanceId === instance.instanceId);
    return {
      instanceId: instance.instanceId,
      modelId: assignments.modelId,
      sharding: instance.sharding,
      engine: engineName(instance.engine),
      ranks,
      serving: ranks.every((r) => r.serving),
      activeRequests: tasks.filter((t) => t.status === "Running" || t.status === "Pending").length,
    };
  });
}

// Models with an instance that can answer right now: what the chat can talk to.
export function servingModels(state) {
  return [...new Set(instanceRows(state).filter((i) => i.serving).map((i) => i.modelId))].sort();
}

export function formatDuration(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return "-";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

// One row per node and model with files: what the Downloads page shows and which of
// cancel (a running download), resume (a stopped one) and delete (files kept, not in use
// by an instance on that node, not in a read-only dir) it offers.
export function downloadRows(state) {
  const rows = [];
  for (const [nodeId, perModel] of Object.entries(state.downloads)) {
    for (const [modelId, progress] of Object.entries(perModel)) {
      let fraction = null;
      let text = progress.kind.replace(/^Download/, "");
      let speed = null;
      let eta = null;
      let amount = null;
      if (progress.kind === "DownloadOngoing") {
        fraction = progress.totalBytes > 0 ? progress.downloadedBytes / progress.totalBytes : 0;
        speed = `${formatBytes(progress.bytesPerSecond)}/s`;
        eta = progress.etaSeconds == null ? null : `${Math.round(progress.etaSeconds)} s left`;
        amount = `${formatBytes(progress.downloadedBytes)} of ${formatBytes(progress.totalBytes)} (${Math.floor(100 * fraction)}%)`;
        text = `${formatBytes(progress.downloadedBytes)} of ${formatBytes(progress.totalBytes)}, ${speed}${eta ? `, ${eta}` : ""}`;
      } else if (progress.kind === "DownloadCancelled") {
        fraction = progress.totalBytes > 0 ? progress.downloadedBytes / progress.totalBytes : 0;
        text = `cancelled, ${formatBytes(progress.downloadedBytes)} of ${formatBytes(progress.totalBytes)} kept`;
      } else if (progress.kind === "DownloadFailed") {
        text = `Failed: ${progress.errorMessage}`;
      } else if (progress.kind === "DownloadCompleted") {
        const part = progress.layers ? `layers ${progress.layers[0]}-${progress.layers[1] - 1}, ` : "";
        text = `downloaded, ${part}${formatBytes(progress.totalBytes)}`;
        fraction = 1;
      } else if (progress.kind === "DownloadPending") {
        text = "waiting to start";
      }
      const inUse = instancesOnNode(state, nodeId).some((instance) => instance.shardAssignments.modelId === modelId);
      const stopped = progress.kind === "DownloadCancelled" || progress.kind === "DownloadFailed";
      rows.push({
        nodeId,
        node: nodeName(state, nodeId),
        modelId,
        kind: progress.kind,
        status: progress.kind.replace(/^Download/, "").toLowerCase(),
        text,
        // What the Downloads page shows beside its speed and time-left columns.
        shown: amount ?? text,
        fraction,
        speed,
        eta,
        path: progress.path ?? null,
        readOnly: Boolean(progress.readOnly),
        inUse,
        canCancel: !inUse && (progress.kind === "DownloadOngoing" || progress.kind === "DownloadPending"),
        canResume: stopped,
        canDelete: !inUse && !progress.readOnly && progress.kind !== "DownloadOngoing",
      });
    }
  }
  return rows.sort((a, b) => a.modelId.localeCompare(b.modelId) || a.node.localeCompare(b.node));
}

function instancesOnNode(state, nodeId) {
  return Object.values(state.instances).filter((instance) => nodeId in instance.shardAssignments.nodeToRunner);
}

// Splits a text/event-stream buffer into complete events; `rest` is an unfinished tail.
// Comments (": prefill 512/2048") come back as {comment}, data lines as {data}.
export function parseSse(buffer) {
  const events = [];
  const blocks = buffer.split(/\r?\n\r?\n/);
  const rest = blocks.pop();
  for (const block of blocks) {
    const data = [];
    for (const line of block.split(/\r?\n/)) {
      if (line.startsWith(":")) events.push({ comment: line.slice(1).trim() });
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    if (data.length) events.push({ data: data.join("\n") });
  }
  return { events, rest };
}

// Folds Chat Completions stream events into what the chat shows so far.
export function foldChatStream(reply, event) {
  const next = { ...reply };
  if (event.comment !== undefined) {
    const match = /^prefill (\d+)\/(\d+)$/.exec(event.comment);
    if (match) next.prefill = { done: Number(match[1]), total: Number(match[2]) };
    return next;
  }
  if (event.data === "[DONE]") {
    next.done = true;
    return next;
  }
  const chunk = JSON.parse(event.data);
  if (chunk.error) {
    next.error = chunk.error.message ?? String(chunk.error);
    return next;
  }
  for (const choice of chunk.choices ?? []) {
    const delta = choice.delta ?? {};
    if (delta.reasoning_content) next.reasoning = (next.reasoning ?? "") + delta.reasoning_content;
    if (delta.content) next.content = (next.content ?? "") + delta.content;
    for (const call of delta.tool_calls ?? []) {
      const calls = [...(next.toolCalls ?? [])];
      const existing = calls[call.index] ?? { id: "", name: "", arguments: "" };
      calls[call.index] = {
        id: existing.id || call.id || "",
        name: existing.name + (call.function?.name ?? ""),
        arguments: existing.arguments + (call.function?.arguments ?? ""),
      };
      next.toolCalls = calls;
    }
    if (choice.finish_reason) next.finishReason = choice.finish_reason;
  }
  if (chunk.usage) next.usage = chunk.usage;
  // exo's own extra on the final chunk: prompt and generation speed measured by the engine.
  if (chunk.generation_stats) next.stats = chunk.generation_stats;
  return next;
}

// The API's messages name nodes by id; the page names them as everywhere else.
export function withNodeNames(state, text) {
  let out = text;
  for (const nodeId of Object.keys(state.nodes)) out = out.replaceAll(`node ${nodeId}`, nodeName(state, nodeId)).replaceAll(nodeId, nodeName(state, nodeId));
  return out;
}

// /instance/previews as table rows: where each option would put the model, or why it can't.
export function previewRows(state, previews) {
  return previews.map((preview) => ({
    nodes: preview.nodeIds.map((id) => nodeName(state, id)).join(" → "),
    sharding: preview.sharding,
    memory: preview.nodeIds
      .map((id) => {
        const available = preview.memoryAvailableBytes[id];
        const needed = formatBytes(preview.memoryNeededBytes[id]);
        // On a CUDA node the share must fit the GPU's memory, not the RAM.
        const gpu = preview.memoryKind?.[id] === "gpu" ? " GPU" : "";
        return available === undefined ? needed : `${needed} of ${formatBytes(available)}${gpu}`;
      })
      .join(", "),
    verdict: preview.error ? withNodeNames(state, preview.error) : fitVerdict(state, preview.disaggregation),
    fits: preview.instance !== null && preview.instance !== undefined,
  }));
}

// A one-node option that another node would prefill for (placement's disaggregation rule).
function fitVerdict(state, plan) {
  if (!plan?.worthIt) return "fits";
  const seconds = (s) => `${s.toFixed(2)} s`;
  return (
    `fits; prefilling on ${nodeName(state, plan.prefillNode)} would cut the first token on ` +
    `${plan.promptTokens.toLocaleString("en")} tokens from ${seconds(plan.ttftAloneSeconds)} to ${seconds(plan.ttftSeconds)}`
  );
}

// Where to draw the cluster: nodes evenly on a circle (the master at the top), each
// node's label on its outer side so no link line crosses it, and one line per pair of
// nodes that reach each other (from circle edge to circle edge), labelled beside its
// middle with the slower direction. `viewBox` frames everything drawn.
export const NODE_RADIUS = 26;
const LINE_HEIGHT = 14;
const CHAR_WIDTH = 6.6;

function labelFor(node, centre, lines) {
  const dx = node.x - centre;
  const dy = node.y - centre;
  const length = Math.hypot(dx, dy);
  // A lone node: its label below it.
  const [ux, uy] = length < 1 ? [0, 1] : [dx / length, dy / length];
  const gap = NODE_RADIUS + 10;
  const x = node.x + ux * gap;
  const anchor = ux > 0.45 ? "start" : ux < -0.45 ? "end" : "middle";
  const width = Math.max(...lines.map((line) => line.length)) * CHAR_WIDTH;
  const height = lines.length * LINE_HEIGHT;
  // Below the node when pointing down, above when pointing up, centred on it sideways.
  const top = uy > 0.45 ? node.y + uy * gap : uy < -0.45 ? node.y + uy * gap - height : node.y - height / 2;
  const left = anchor === "start" ? x : anchor === "end" ? x - width : x - width / 2;
  return { x, top, anchor, lines, lineHeight: LINE_HEIGHT, box: { x: left, y: top, width, height } };
}

export function topologyLayout(state, size = 320) {
  const rows = nodeRows(state);
  const centre = size / 2;
  const radius = rows.length > 1 ? size / 2 - 48 : 0;
  const nodes = rows.map((row, i) => {
    const angle = -Math.PI / 2 + (2 * Math.PI * i) / rows.length;
    const placed = { ...row, x: centre + radius * Math.cos(angle), y: centre + radius * Math.sin(angle) };
    const memory = `${formatBytes(row.memoryUsed)} / ${formatBytes(row.memoryTotal)}`;
    return { ...placed, label: labelFor(placed, centre, [row.name, `${memory} · ${row.engine}`]) };
  });
  const at = Object.fromEntries(nodes.map((node) => [node.nodeId, node]));
  const pairs = new Map();
  for (const link of state.topology.connections) {
    if (!at[link.source] || !at[link.sink]) continue;
    const key = [link.source, link.sink].sort().join(" ");
    const pair = pairs.get(key) ?? { from: at[link.source], to: at[link.sink], directions: 0, latencyMs: null };
    pair.directions += 1;
    if (link.latencyMs !== null && link.latencyMs !== undefined) {
      pair.latencyMs = Math.max(pair.latencyMs ?? 0, link.latencyMs);
    }
    pairs.set(key, pair);
  }
  const edges = [...pairs.values()].map((pair) => {
    const dx = pair.to.x - pair.from.x;
    const dy = pair.to.y - pair.from.y;
    const length = Math.hypot(dx, dy) || 1;
    const [ux, uy] = [dx / length, dy / length];
    const label = pair.latencyMs === null ? "" : `${pair.latencyMs.toFixed(1)} ms`;
    // Beside the middle of the line, on its right-hand side, clear of the stroke.
    const side = { x: (pair.from.x + pair.to.x) / 2 - uy * 8, y: (pair.from.y + pair.to.y) / 2 + ux * 8 };
    return {
      x1: pair.from.x + ux * NODE_RADIUS,
      y1: pair.from.y + uy * NODE_RADIUS,
      x2: pair.to.x - ux * NODE_RADIUS,
      y2: pair.to.y - uy * NODE_RADIUS,
      bothWays: pair.directions === 2,
      label,
      labelX: side.x,
      labelY: side.y + 4,
      labelAnchor: -uy > 0.3 ? "start" : -uy < -0.3 ? "end" : "middle",
    };
  });
  const boxes = [
    ...nodes.map((n) => ({ x: n.x - NODE_RADIUS, y: n.y - NODE_RADIUS, width: 2 * NODE_RADIUS, height: 2 * NODE_RADIUS })),
    ...nodes.map((n) => n.label.box),
  ];
  const pad = 8;
  const minX = Math.min(0, ...boxes.map((b) => b.x)) - pad;
  const minY = Math.min(...boxes.map((b) => b.y), centre) - pad;
  const maxX = Math.max(size, ...boxes.map((b) => b.x + b.width)) + pad;
  const maxY = Math.max(...boxes.map((b) => b.y + b.height), centre) + pad;
  return { size, nodes, edges, viewBox: [minX, minY, maxX - minX, maxY - minY] };
}

// Whether the segment from (x1, y1) to (x2, y2) passes through the box (Liang-Barsky).
export function segmentCrossesBox(x1, y1, x2, y2, box) {
  let t0 = 0;
  let t1 = 1;
  const dx = x2 - x1;
  const dy = y2 - y1;
  const edges = [
    [-dx, x1 - box.x],
    [dx, box.x + box.width - x1],
    [-dy, y1 - box.y],
    [dy, box.y + box.height - y1],
  ];
  for (const [p, q] of edges) {
    if (p === 0) {
      if (q < 0) return false;
    } else {
      const t = q / p;
      if (p < 0) t0 = Math.max(t0, t);
      else t1 = Math.min(t1, t);
      if (t0 > t1) return false;
    }
  }
  return true;
}

// A fetch that sends the node's API key (--api-key) kept in `storage` (the browser's
// localStorage) and, on a 401, asks for it once (`askKey(refusedKey)`; concurrent calls
// share the question), keeps it and tries again. Declined once, it asks no more.
export function keyedFetch(fetchFn, storage, askKey, keyName = "exo-api-key") {
  let asking = null;
  let declined = false;
  return async function api(path, options = {}) {
    for (let attempt = 0; ; attempt++) {
      const key = storage.getItem(keyName);
      const headers = { ...(options.headers ?? {}), ...(key ? { Authorization: `Bearer ${key}` } : {}) };
      const response = await fetchFn(path, { ...options, headers });
      if (response.status !== 401 || attempt > 0 || declined) return response;
      asking ??= Promise.resolve(askKey(key)).finally(() => {
        asking = null;
      });
      const given = (await asking)?.trim();
      if (!given) {
        declined = true;
        return response;
      }
      storage.setItem(keyName, given);
    }
  };
}

// The header's one line: how many nodes, who is master, what serves. No internals.
export function clusterSummary(state) {
  const nodes = Object.keys(state.nodes).length;
  const serving = servingModels(state).length;
  const master = state.masterNodeId ? nodeName(state, state.masterNodeId) : "electing a master";
  return `${nodes} node${nodes === 1 ? "" : "s"} · ${master}${state.masterNodeId ? " leads" : ""} · ${serving} model${serving === 1 ? "" : "s"} serving`;
}

// Where each model's files are, per node (from the download records in State, which
// also name the models found in a node's models dirs).
function filesByModel(state) {
  const where = {};
  for (const [nodeId, perModel] of Object.entries(state.downloads)) {
    for (const [modelId, progress] of Object.entries(perModel)) {
      if (progress.kind !== "DownloadCompleted") continue;
      (where[modelId] ??= []).push({
        nodeId,
        node: nodeName(state, nodeId),
        path: progress.path,
        readOnly: Boolean(progress.readOnly),
        partial: Boolean(progress.layers),
      });
    }
  }
  return where;
}

// The Models page's catalog: every card (GET /models, snake_case), what it is, where its
// files are, whether an instance runs it; filtered by a search over id, family and
// capabilities and by `show` ("all", "downloaded", "serving").
export function catalogRows(cards, state, search = "", show = "all") {
  const where = filesByModel(state);
  const instances = instanceRows(state);
  const words = search.toLowerCase().split(/\s+/).filter(Boolean);
  return cards
    .map((card) => {
      const running = instances.filter((instance) => instance.modelId === card.model_id);
      return {
        id: card.model_id,
        family: card.family || "-",
        quantization: card.quantization || "",
        sizeBytes: card.storage_size?.in_bytes ?? 0,
        size: formatBytes(card.storage_size?.in_bytes),
        layers: card.n_layers,
        contextLength: card.context_length ?? null,
        capabilities: card.capabilities ?? ["text"],
        dialect: card.reasoning_dialect ?? "none",
        supportsTensor: Boolean(card.supports_tensor),
        downloadedOn: where[card.model_id] ?? [],
        instances: running.map((instance) => ({ instanceId: instance.instanceId, serving: instance.serving })),
        serving: running.some((instance) => instance.serving),
        // Added through the API (from the hub): its card can be removed again.
        custom: card.model_id in (state.customModelCards ?? {}),
      };
    })
    .filter((row) => {
      const haystack = [row.id, row.family, row.quantization, ...row.capabilities].join(" ").toLowerCase();
      if (!words.every((word) => haystack.includes(word))) return false;
      if (show === "downloaded") return row.downloadedOn.length > 0;
      if (show === "serving") return row.instances.length > 0;
      return true;
    })
    .sort((a, b) => Number(b.serving) - Number(a.serving) || b.downloadedOn.length - a.downloadedOn.length || a.id.localeCompare(b.id));
}

// What placing one preview sends: the preview's own instance (POST /instance puts it on
// exactly those nodes), with sharding and node count for /place_instance if it has none.
export function placementOption(preview) {
  return { sharding: preview.sharding, minNodes: preview.nodeIds.length, instance: preview.instance ?? null };
}

// The same one-node option with its prompts prefilled where placement's rule proposes;
// null where it proposes none. /place_instance places both sides.
export function disaggregatedOption(preview) {
  const plan = preview.disaggregation;
  if (!plan?.worthIt || !preview.instance) return null;
  return { prefillNodeId: plan.prefillNode, decodeNodeId: plan.decodeNode };
}

// One line from a model's /instance/previews: the smallest placement that fits, or why
// none does (the closest option's reason).
export function fitSummary(state, previews) {
  if (!previews) return { fits: null, text: "checking…", option: null };
  const fitting = previews.filter((p) => p.instance !== null && p.instance !== undefined);
  if (fitting.length > 0) {
    const best = [...fitting].sort((a, b) => a.nodeIds.length - b.nodeIds.length)[0];
    const nodes = best.nodeIds.length;
    const on = nodes === 1 ? nodeName(state, best.nodeIds[0]) : `${nodes} nodes`;
    return { fits: true, text: `fits on ${on} (${best.sharding})`, option: placementOption(best) };
  }
  const reason = previews.find((p) => p.error)?.error ?? "no node can hold it";
  return { fits: false, text: withNodeNames(state, reason), option: null };
}

// Every models dir holding a model, per node: the parent of each model's dir.
export function modelDirs(state) {
  const dirs = new Map();
  for (const [modelId, places] of Object.entries(filesByModel(state))) {
    for (const place of places) {
      const dir = place.path.replace(/[\\/][^\\/]+[\\/]?$/, "") || place.path;
      const key = `${place.nodeId} ${dir}`;
      const entry = dirs.get(key) ?? { node: place.node, nodeId: place.nodeId, dir, readOnly: place.readOnly, models: [] };
      entry.models.push(modelId);
      dirs.set(key, entry);
    }
  }
  return [...dirs.values()].sort((a, b) => a.node.localeCompare(b.node) || a.dir.localeCompare(b.dir));
}

// Placements the page asked for (`placing`: model id -> {instanceId}) against State:
// which still load (with their progress), which serve now, which failed and why.
export function placementProgress(state, placing) {
  const instances = instanceRows(state);
  const out = { loading: [], serving: [], failed: [] };
  for (const [modelId, asked] of Object.entries(placing)) {
    const instance = instances.find((i) => i.instanceId === asked.instanceId);
    if (instance?.serving || servingModels(state).includes(modelId)) {
      out.serving.push(modelId);
    } else if (instance) {
      const failed = instance.ranks.find((rank) => rank.status.failed);
      if (failed) out.failed.push({ modelId, reason: failed.status.text });
      else {
        const loading = instance.ranks.map((r) => r.status.progress).filter((p) => p !== null);
        const progress = loading.length ? loading.reduce((a, b) => a + b, 0) / instance.ranks.length : null;
        out.loading.push({ modelId, progress, text: instance.ranks.map((r) => r.status.text).join(", ") });
      }
    } else if (state.instanceDeletions?.[asked.instanceId]) {
      out.failed.push({ modelId, reason: state.instanceDeletions[asked.instanceId] });
    } else {
      out.loading.push({ modelId, progress: null, text: "waiting for the master" });
    }
  }
  return out;
}

// Conversations live in the browser's localStorage, one JSON list under `key`.
export const CONVERSATIONS_KEY = "exo-conversations";

export function loadConversations(storage, key = CONVERSATIONS_KEY) {
  try {
    const list = JSON.parse(storage.getItem(key) ?? "[]");
    return Array.isArray(list) ? list.filter((c) => c && Array.isArray(c.messages)) : [];
  } catch {
    return [];
  }
}

export function saveConversations(storage, conversations, key = CONVERSATIONS_KEY) {
  storage.setItem(key, JSON.stringify(conversations));
}

export function newConversation(model, now = Date.now()) {
  return { id: `c${now.toString(36)}${Math.random().toString(36).slice(2, 6)}`, title: "New chat", model, created: now, messages: [] };
}

// A conversation's title from its first question, until the user renames it.
export function titleFrom(text) {
  const line = text.trim().split("\n")[0];
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || "New chat";
}

function completeArguments(text) {
  try {
    JSON.parse(text || "{}");
    return true;
  } catch {
    return false;
  }
}

// An assistant turn's tool calls in Chat Completions' shape. A call the stream gave no id
// gets one from its place in the conversation, so a tool result can still name it; a call
// cut off mid-arguments (a stopped reply) is left out: its JSON would not parse.
export function requestToolCalls(message, turn) {
  return (message.toolCalls ?? [])
    .map((call, i) => [call, i])
    .filter(([call]) => call.name && completeArguments(call.arguments))
    .map(([call, i]) => ({
      id: call.id || `call_${turn}_${i}`,
      type: "function",
      function: { name: call.name, arguments: call.arguments || "{}" },
    }));
}

// The calls of the conversation's last reply that have no result yet, with the ids the
// request gives them: what the page offers to answer.
export function pendingToolCalls(conversation) {
  const messages = conversation.messages;
  const turn = messages.findLastIndex((m) => m.role === "assistant");
  if (turn < 0 || messages.slice(turn + 1).some((m) => m.role === "user")) return [];
  const answered = new Set(messages.slice(turn + 1).map((m) => m.toolCallId));
  return requestToolCalls(messages[turn], turn).filter((call) => !answered.has(call.id));
}

// What the chat sends: each earlier assistant turn carries its reasoning back as
// `reasoning_content` (the dialects that use it need it; the others ignore it) and its
// tool calls as `tool_calls` (the templates render them, so the model sees what it asked
// for), then the results the user gave for them as `tool` messages; images as Chat
// Completions image_url parts.
export function requestMessages(conversation) {
  return conversation.messages
    .map((m, turn) => [m, turn])
    .filter(([m, turn]) => !m.error || m.content || m.reasoning || requestToolCalls(m, turn).length)
    .map(([m, turn]) => {
      if (m.role === "assistant") {
        const out = { role: "assistant", content: m.content ?? "" };
        if (m.reasoning) out.reasoning_content = m.reasoning;
        const calls = requestToolCalls(m, turn);
        if (calls.length) out.tool_calls = calls;
        return out;
      }
      if (m.role === "tool") return { role: "tool", tool_call_id: m.toolCallId, content: m.content };
      if (m.images?.length) {
        return {
          role: m.role,
          content: [{ type: "text", text: m.content }, ...m.images.map((url) => ({ type: "image_url", image_url: { url } }))],
        };
      }
      return { role: m.role, content: m.content };
    });
}

// The line under a finished reply: its speed as the engine measured it, else as the page did.
export function replyStats(reply, timings = {}) {
  const parts = [];
  const stats = reply.stats;
  const generated = stats?.generation_tokens ?? reply.usage?.completion_tokens;
  if (generated) parts.push(`${generated} tokens`);
  if (stats?.generation_tps) parts.push(`${stats.generation_tps.toFixed(1)} tokens/s`);
  else if (generated && timings.firstToken && timings.end > timings.firstToken) {
    parts.push(`${((1000 * generated) / (timings.end - timings.firstToken)).toFixed(1)} tokens/s`);
  }
  if (stats?.prompt_tokens) parts.push(`prompt ${stats.prompt_tokens} tokens at ${stats.prompt_tps.toFixed(0)}/s`);
  if (timings.firstToken && timings.start) parts.push(`first token ${Math.round(timings.firstToken - timings.start)} ms`);
  if (reply.finishReason && reply.finishReason !== "stop") parts.push(reply.finishReason);
  return parts.join(" · ");
}

export function hasVision(card) {
  return Boolean(card?.capabilities?.includes("vision"));
}

// opencode's `interleaved` tells its OpenAI-compatible adapter to send an assistant's
// earlier reasoning back as `reasoning_content`: for the dialects whose templates read it
// (DeepSeek V3.2/V4's tool_conditional, Qwen3/GLM/MiniMax's post_last_user, gpt-oss's
// channel, which exo bridges to Harmony's `thinking`); Kimi's suffix keeps reasoning in
// the content, and `none` has no reasoning to send.
export const INTERLEAVED_DIALECTS = new Set(["tool_conditional", "post_last_user", "channel"]);

export function opencodeConfig(baseUrl, cards, apiKey = "") {
  const models = {};
  for (const card of cards) {
    const entry = { name: card.model_id };
    const context = card.context_length ?? 0;
    if (context > 0) entry.limit = { context, output: Math.min(context, 16384) };
    if (hasVision(card)) entry.modalities = { input: ["text", "image"], output: ["text"] };
    if (INTERLEAVED_DIALECTS.has(card.reasoning_dialect)) entry.interleaved = { field: "reasoning_content" };
    models[card.model_id] = entry;
  }
  return {
    $schema: "https://opencode.ai/config.json",
    provider: {
      exo: {
        npm: "@ai-sdk/openai-compatible",
        name: "exo",
        options: { baseURL: `${baseUrl}/v1`, ...(apiKey ? { apiKey } : {}) },
        models,
      },
    },
  };
}

export function claudeCodeEnv(baseUrl, model, apiKey = "") {
  return [
    `export ANTHROPIC_BASE_URL=${baseUrl}`,
    `export ANTHROPIC_AUTH_TOKEN=${apiKey || "unused"}`,
    `export ANTHROPIC_MODEL=${model}`,
    `export ANTHROPIC_DEFAULT_SONNET_MODEL=${model}`,
    `export ANTHROPIC_DEFAULT_OPUS_MODEL=${model}`,
    `export ANTHROPIC_DEFAULT_HAIKU_MODEL=${model}`,
    "export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
    "claude",
  ].join("\n");
}

export function codexConfig(baseUrl, model, apiKey = "") {
  return [
    "# ~/.codex/config.toml",
    `model = "${model}"`,
    'model_provider = "exo"',
    "",
    "[model_providers.exo]",
    'name = "exo"',
    `base_url = "${baseUrl}/v1"`,
    'wire_api = "responses"',
    ...(apiKey ? ['env_key = "EXO_API_KEY"', "", `# export EXO_API_KEY=${apiKey}`] : []),
  ].join("\n");
}

export function openWebUiConfig(baseUrl, apiKey = "") {
  return [
    "# Open WebUI: Admin Settings → Connections, or these environment variables",
    `OPENAI_API_BASE_URL=${baseUrl}/v1`,
    `OPENAI_API_KEY=${apiKey || "unused"}`,
    `OLLAMA_BASE_URL=${baseUrl}/ollama`,
  ].join("\n");
}
