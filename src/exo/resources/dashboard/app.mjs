// The dashboard's shell: the API with its key, polling State, the pages by URL hash, the
// header and the placements under way; the Cluster and Downloads pages. What is shown is
// computed by view.mjs; the other pages are in models.mjs, chat.mjs and integrations.mjs.
import { $, apiError, badge, bar, el, renderInto, renderOptions, svg } from "./dom.mjs";
import { renderIntegrations, setupIntegrations } from "./integrations.mjs";
import { renderChat, setupChat } from "./chat.mjs";
import { renderModels, setupModels } from "./models.mjs";
import {
  clusterSummary,
  downloadRows,
  formatBytes,
  instanceRows,
  keyedFetch,
  linkRows,
  nodeRows,
  placementProgress,
  shortId,
  topologyLayout,
} from "./view.mjs";

// Asked once per refusal, in a dialog of the page's own (window.prompt blocks the page).
function askKey(refused) {
  const dialog = $("key-dialog");
  $("key-reason").textContent = refused
    ? "That API key was refused. Enter this exo node's API key:"
    : "This exo node needs its API key (given with --api-key):";
  $("key-input").value = "";
  return new Promise((resolve) => {
    dialog.addEventListener("close", () => resolve(dialog.returnValue === "ok" ? $("key-input").value : null), {
      once: true,
    });
    dialog.showModal();
  });
}

const store = {
  api: keyedFetch(window.fetch.bind(window), window.localStorage, askKey),
  state: null,
  cards: [],
  // Placements asked from this page: model id -> {instanceId}, until the model serves.
  placing: {},
  notices: [],
  page: "cluster",
  render: () => render(),
  loadCards: () => loadCards(),
  notify,
};

function notify(text, kind = "ok", seconds = 6) {
  const notice = { text, kind, until: Date.now() + seconds * 1000 };
  store.notices.push(notice);
  renderPlacing();
  setTimeout(renderPlacing, seconds * 1000 + 50);
}

const PAGES = ["cluster", "models", "downloads", "chat", "integrations"];

function route() {
  const page = location.hash.replace(/^#\/?/, "").split("/")[0];
  store.page = PAGES.includes(page) ? page : "cluster";
  for (const name of PAGES) {
    $(`page-${name}`).hidden = name !== store.page;
    document.querySelector(`#nav a[data-page="${name}"]`).classList.toggle("active", name === store.page);
  }
  render();
}

function renderTopology(state) {
  const { nodes, edges, viewBox } = topologyLayout(state);
  const parts = [];
  for (const edge of edges) {
    // A link seen one way only cannot carry an MLX ring: dashed.
    parts.push(svg("line", { x1: edge.x1, y1: edge.y1, x2: edge.x2, y2: edge.y2, class: edge.bothWays ? "link" : "link one-way" }));
    if (edge.label) {
      parts.push(svg("text", { x: edge.labelX, y: edge.labelY, "text-anchor": edge.labelAnchor, class: "link-label" }, edge.label));
    }
  }
  for (const node of nodes) {
    parts.push(svg("circle", { cx: node.x, cy: node.y, r: 26, class: node.isMaster ? "node master" : "node" }));
    parts.push(svg("text", { x: node.x, y: node.y + 4, class: "node-memory" }, `${node.memoryPercent}%`));
    const { label } = node;
    label.lines.forEach((line, i) => {
      const y = label.top + (i + 1) * label.lineHeight - 3;
      parts.push(svg("text", { x: label.x, y, "text-anchor": label.anchor, class: i === 0 ? "node-label" : "node-detail" }, line));
    });
  }
  $("topology").setAttribute("viewBox", viewBox.join(" "));
  $("topology").replaceChildren(...parts);
}

async function deleteInstance(instanceId) {
  const response = await store.api(`/instance/${instanceId}`, { method: "DELETE" });
  if (!response.ok) notify(await apiError(response), "bad");
}

function instanceCard(instance) {
  return el(
    "div",
    { class: "card wide" },
    el(
      "div",
      { class: "title" },
      el("span", { class: "model-id" }, instance.modelId),
      badge(instance.serving ? "serving" : "starting", instance.serving ? "ok" : ""),
      el("button", { class: "small danger", onclick: () => deleteInstance(instance.instanceId) }, "Delete"),
    ),
    el(
      "div",
      { class: "muted" },
      `${instance.engine} · ${instance.sharding} · ${instance.ranks.length} rank${instance.ranks.length === 1 ? "" : "s"} · ` +
        `${instance.activeRequests} active request${instance.activeRequests === 1 ? "" : "s"}`,
    ),
    ...instance.ranks.map((rank) =>
      el(
        "div",
        { class: rank.status.failed ? "rank failed" : "rank" },
        `rank ${rank.rank} on ${rank.node}, layers ${rank.layers}: ${rank.status.text}`,
        rank.status.progress !== null ? bar(rank.status.progress) : null,
      ),
    ),
  );
}

function renderCluster(state) {
  renderTopology(state);
  const instances = instanceRows(state);
  const nodes = nodeRows(state);
  const nodesKey = nodes.map((n) => [n.name, n.isMaster, n.memoryPercent, n.gpus.map((g) => g.percent), n.engine, n.diskAvailable, instances.length]);
  renderInto($("nodes"), nodesKey, () =>
    nodes.map((node) => {
      const here = instances.filter((i) => i.ranks.some((r) => r.node === node.name)).map((i) => i.modelId);
      return el(
        "div",
        { class: "card" },
        el("div", { class: "title" }, node.name, node.isMaster ? badge("master", "accent") : null),
        el("div", { class: "muted" }, `${shortId(node.nodeId)} · ${node.engine} · ${node.cpuCount} CPUs · ${node.os}`),
        el("div", {}, `memory ${formatBytes(node.memoryUsed)} of ${formatBytes(node.memoryTotal)}`),
        bar(node.memoryPercent / 100),
        ...node.gpus.flatMap((gpu) => [el("div", {}, `GPU ${gpu.name}: ${formatBytes(gpu.used)} of ${formatBytes(gpu.total)}`), bar(gpu.percent / 100)]),
        el("div", { class: "muted" }, `disk free ${formatBytes(node.diskAvailable)}`),
        el("div", { class: "muted" }, here.length ? `runs ${here.join(", ")}` : "runs no model"),
      );
    }),
  );
  // The most recent few removals, with why: a failed instance explains itself here.
  const deleted = Object.entries(state.instanceDeletions ?? {}).slice(-3);
  renderInto($("instances"), [instances, deleted], () => [
    ...(instances.length === 0
      ? [el("p", { class: "muted" }, "No model is placed yet. ", el("a", { href: "#/models" }, "Pick one on the Models page."))]
      : []),
    ...instances.map(instanceCard),
    ...deleted.map(([instanceId, reason]) => el("p", { class: "muted" }, `Instance ${shortId(instanceId)} was removed: ${reason}`)),
  ]);
  const fmt = (value, unit) => (value === null || value === undefined ? "measuring…" : `${value.toFixed(1)} ${unit}`);
  const links = linkRows(state);
  renderInto($("links").tBodies[0], links, () => [
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
  ]);
}

async function downloadAction(row, action) {
  if (action === "delete" && !window.confirm(`Delete the files of ${row.modelId} on ${row.node}?`)) return;
  const body = JSON.stringify({ model_id: row.modelId, node_id: row.nodeId });
  const json = { "Content-Type": "application/json" };
  const response =
    action === "delete"
      ? await store.api(`/download/${encodeURIComponent(row.nodeId)}/${row.modelId}`, { method: "DELETE" })
      : await store.api(`/download/${action}`, { method: "POST", headers: json, body });
  $("downloads-message").textContent = response.ok ? (await response.json()).message : await apiError(response);
}

function renderDownloadForm(state) {
  const ids = store.cards.map((card) => card.model_id);
  renderOptions($("download-model"), ids);
  renderOptions($("download-node"), nodeRows(state).map((node) => [node.nodeId, `on ${node.name}`]));
}

async function startDownload(event) {
  event.preventDefault();
  await downloadAction({ modelId: $("download-model").value, nodeId: $("download-node").value }, "start");
}

function renderDownloads(state) {
  renderDownloadForm(state);
  const rows = downloadRows(state);
  renderInto($("downloads"), rows, () => {
    if (rows.length === 0) {
      return [el("p", { class: "muted" }, "No node holds or fetches a model yet. ", el("a", { href: "#/models" }, "Download one from Models."))];
    }
    const header = el("div", { class: "dl-row dl-head" }, ...["Model", "Node", "Progress", "Speed", "Left", ""].map((t) => el("span", {}, t)));
    return [
      header,
      ...rows.map((row) =>
        el(
          "div",
          { class: `dl-row ${row.status}`, "data-model": row.modelId, "data-node": row.nodeId },
          el("span", { class: "model-id" }, row.modelId),
          el("span", { class: "dl-node" }, row.node),
          el(
            "span",
            { class: "dl-progress" },
            el("span", { class: "dl-text" }, row.shown),
            row.fraction !== null ? bar(row.fraction) : null,
            row.path ? el("span", { class: "muted path" }, row.path, row.readOnly ? " (read-only)" : "") : null,
          ),
          el("span", { class: "dl-speed" }, row.speed ?? ""),
          el("span", { class: "dl-eta" }, row.eta ?? ""),
          el(
            "span",
            { class: "dl-actions" },
            row.canCancel ? el("button", { class: "small", onclick: () => downloadAction(row, "cancel") }, "Cancel") : null,
            row.canResume ? el("button", { class: "small", onclick: () => downloadAction(row, "start") }, "Resume") : null,
            row.canDelete ? el("button", { class: "small danger", onclick: () => downloadAction(row, "delete") }, "Delete") : null,
            row.inUse ? badge("in use") : null,
          ),
        ),
      ),
    ];
  });
}

// Placements under way, cleared as each model serves; and short notices.
function renderPlacing() {
  const box = $("placing");
  const items = [];
  if (store.state) {
    const progress = placementProgress(store.state, store.placing);
    for (const modelId of progress.serving) {
      delete store.placing[modelId];
      store.notices.push({ text: `${modelId} is serving.`, kind: "ok", until: Date.now() + 6000, chat: true });
    }
    for (const failed of progress.failed) {
      delete store.placing[failed.modelId];
      store.notices.push({ text: `${failed.modelId} could not start: ${failed.reason}`, kind: "bad", until: Date.now() + 20000 });
    }
    for (const loading of progress.loading) {
      items.push(
        el(
          "div",
          { class: "notice" },
          `placing ${loading.modelId}… ${loading.text}`,
          loading.progress !== null ? bar(loading.progress) : null,
        ),
      );
    }
  }
  store.notices = store.notices.filter((n) => n.until > Date.now());
  for (const notice of store.notices) {
    items.push(
      el("div", { class: `notice ${notice.kind}` }, notice.text, notice.chat ? el("a", { href: "#/chat" }, " Chat with it") : null),
    );
  }
  box.hidden = items.length === 0;
  box.replaceChildren(...items);
}

function render() {
  const state = store.state;
  if (!state) return;
  $("cluster-summary").textContent = clusterSummary(state);
  renderPlacing();
  if (store.page === "cluster") renderCluster(state);
  if (store.page === "models") renderModels(store);
  if (store.page === "downloads") renderDownloads(state);
  if (store.page === "chat") renderChat(store);
  if (store.page === "integrations") renderIntegrations(store);
}

async function poll() {
  try {
    const response = await store.api("/state");
    if (!response.ok) throw new Error(await apiError(response));
    store.state = await response.json();
    $("connection").textContent = "online";
    $("connection").className = "badge ok";
    render();
  } catch {
    $("connection").textContent = "offline";
    $("connection").className = "badge bad";
  }
  setTimeout(poll, 1000);
}

async function loadCards() {
  const response = await store.api("/models");
  if (response.ok) {
    store.cards = await response.json();
    render();
  }
}

$("download-form").addEventListener("submit", startDownload);
setupModels(store);
setupChat(store);
setupIntegrations(store);
window.addEventListener("hashchange", route);
route();
poll();
loadCards();
setInterval(loadCards, 15000);
