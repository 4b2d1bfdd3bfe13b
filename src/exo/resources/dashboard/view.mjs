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

// One row per node: who it is, whether it is the master, and how full its memory is.
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
        cpuCount: info.cpuCount,
        memoryUsed: used,
        memoryTotal: total,
        memoryPercent: total > 0 ? Math.round((100 * used) / total) : 0,
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

export function downloadRows(state) {
  const rows = [];
  for (const [nodeId, perModel] of Object.entries(state.downloads)) {
    for (const [modelId, progress] of Object.entries(perModel)) {
      let fraction = null;
      let text = progress.kind.replace(/^Download/, "");
      if (progress.kind === "DownloadOngoing") {
        fraction = progress.totalBytes > 0 ? progress.downloadedBytes / progress.totalBytes : 0;
        const rate = `${formatBytes(progress.bytesPerSecond)}/s`;
        const eta = progress.etaSeconds == null ? "" : `, ${Math.round(progress.etaSeconds)} s left`;
        text = `${formatBytes(progress.downloadedBytes)} of ${formatBytes(progress.totalBytes)}, ${rate}${eta}`;
      } else if (progress.kind === "DownloadCancelled") {
        fraction = progress.totalBytes > 0 ? progress.downloadedBytes / progress.totalBytes : 0;
        text = `cancelled, ${formatBytes(progress.downloadedBytes)} of ${formatBytes(progress.totalBytes)} kept`;
      } else if (progress.kind === "DownloadFailed") {
        text = `Failed: ${progress.errorMessage}`;
      } else if (progress.kind === "DownloadCompleted") {
        text = `downloaded, ${formatBytes(progress.totalBytes)}`;
        fraction = 1;
      }
      rows.push({ node: nodeName(state, nodeId), modelId, text, fraction });
    }
  }
  return rows;
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
      const existing = calls[call.index] ?? { name: "", arguments: "" };
      calls[call.index] = {
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

// /instance/previews as table rows: where each option would put the model, or why it can't.
export function previewRows(state, previews) {
  return previews.map((preview) => ({
    nodes: preview.nodeIds.map((id) => nodeName(state, id)).join(" → "),
    sharding: preview.sharding,
    memory: preview.nodeIds
      .map((id) => {
        const available = preview.memoryAvailableBytes[id];
        const needed = formatBytes(preview.memoryNeededBytes[id]);
        return available === undefined ? needed : `${needed} of ${formatBytes(available)}`;
      })
      .join(", "),
    verdict: preview.error ?? "fits",
    fits: preview.instance !== null && preview.instance !== undefined,
  }));
}

// Where to draw the cluster: nodes evenly on a circle (the master at the top), and one
// line per pair of nodes that reach each other, labelled with the slower direction.
export function topologyLayout(state, size = 320) {
  const rows = nodeRows(state);
  const centre = size / 2;
  const radius = rows.length > 1 ? size / 2 - 48 : 0;
  const nodes = rows.map((row, i) => {
    const angle = -Math.PI / 2 + (2 * Math.PI * i) / rows.length;
    return { ...row, x: centre + radius * Math.cos(angle), y: centre + radius * Math.sin(angle) };
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
  const edges = [...pairs.values()].map((pair) => ({
    x1: pair.from.x,
    y1: pair.from.y,
    x2: pair.to.x,
    y2: pair.to.y,
    bothWays: pair.directions === 2,
    label: pair.latencyMs === null ? "" : `${pair.latencyMs.toFixed(1)} ms`,
  }));
  return { size, nodes, edges };
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
