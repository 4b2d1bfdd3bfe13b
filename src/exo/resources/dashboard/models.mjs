// The Models page: the searchable catalog (GET /models) with where each model's files
// are and whether it fits (GET /instance/previews), placing, downloading and deleting;
// adding a model from the hub (GET /models/search, POST /models/add, /download/start);
// the models dirs the nodes found models in.
import { $, apiError, badge, el, renderInto } from "./dom.mjs";
import { catalogRows, disaggregatedOption, fitSummary, formatBytes, modelDirs, nodeName, placementOption, previewRows } from "./view.mjs";

const JSON_HEADERS = { "Content-Type": "application/json" };
// Previews are asked again when the cluster's nodes or instances change, or after this.
const PREVIEW_MAX_AGE_MS = 30000;
const previews = new Map();
let previewQueue = [];
let previewsRunning = 0;
let open = null;
// Rows shown at once; "Show more" adds a page (each row asks for its previews).
const PAGE_ROWS = 30;
let shown = PAGE_ROWS;

function clusterKey(state) {
  return [Object.keys(state.nodes).sort(), Object.keys(state.instances).sort()].join("|");
}

function previewsFor(store, modelId) {
  const cached = previews.get(modelId);
  const key = clusterKey(store.state);
  if (cached && cached.key === key && Date.now() - cached.at < PREVIEW_MAX_AGE_MS) return cached.list;
  if (!previewQueue.includes(modelId)) previewQueue.push(modelId);
  drainPreviews(store);
  return cached?.list ?? null;
}

// A few at a time, so opening the page does not fire ninety requests at once.
function drainPreviews(store) {
  while (previewsRunning < 3 && previewQueue.length > 0) {
    const modelId = previewQueue.shift();
    previewsRunning += 1;
    const key = clusterKey(store.state);
    store
      .api(`/instance/previews?${new URLSearchParams({ model_id: modelId })}`)
      .then(async (response) => {
        const list = response.ok ? await response.json() : [{ nodeIds: [], error: await apiError(response) }];
        previews.set(modelId, { key, at: Date.now(), list });
      })
      .catch(() => {})
      .finally(() => {
        previewsRunning -= 1;
        drainPreviews(store);
        store.render();
      });
  }
}

function message(text) {
  $("models-message").textContent = text;
}

// On the nodes the chosen preview names; /place_instance (the master picks) without one.
async function place(store, modelId, option) {
  message(`placing ${modelId}…`);
  const disaggregated = { model_id: modelId, prefill_node_id: option.prefillNodeId, decode_node_id: option.decodeNodeId };
  const response = option.prefillNodeId
    ? await store.api("/place_instance", { method: "POST", headers: JSON_HEADERS, body: JSON.stringify(disaggregated) })
    : option.instance
    ? await store.api("/instance", { method: "POST", headers: JSON_HEADERS, body: JSON.stringify({ instance: option.instance }) })
    : await store.api("/place_instance", {
        method: "POST",
        headers: JSON_HEADERS,
        body: JSON.stringify({ model_id: modelId, sharding: option.sharding, min_nodes: option.minNodes }),
      });
  if (!response.ok) {
    message(await apiError(response));
    return;
  }
  const { instance_id: instanceId } = await response.json();
  store.placing[modelId] = { instanceId };
  message("");
  store.render();
}

async function startDownload(store, modelId, nodeId) {
  const response = await store.api("/download/start", {
    method: "POST",
    headers: JSON_HEADERS,
    body: JSON.stringify({ model_id: modelId, node_id: nodeId }),
  });
  message(response.ok ? `${(await response.json()).message}: see Downloads` : await apiError(response));
}

async function removeCard(store, modelId) {
  const response = await store.api(`/models/${modelId}`, { method: "DELETE" });
  message(response.ok ? `removed the card of ${modelId}` : await apiError(response));
  // The card leaves State a moment after the command.
  setTimeout(() => store.loadCards(), 500);
}

async function deleteInstance(store, instanceId) {
  const response = await store.api(`/instance/${instanceId}`, { method: "DELETE" });
  message(response.ok ? (await response.json()).message : await apiError(response));
}

function optionsTable(store, row, list) {
  if (!list) return el("p", { class: "muted" }, "checking where it fits…");
  const rows = previewRows(store.state, list);
  return el(
    "div",
    { class: "scroll-x" },
    el(
      "table",
      { class: "previews" },
      el("thead", {}, el("tr", {}, ...["nodes", "sharding", "memory per node", "verdict", ""].map((t) => el("th", {}, t)))),
      el(
        "tbody",
        {},
        ...rows.map((preview, i) =>
          el(
            "tr",
            { class: preview.fits ? "" : "rejected" },
            el("td", {}, preview.nodes),
            el("td", {}, preview.sharding),
            el("td", {}, preview.memory),
            el("td", {}, preview.verdict),
            el(
              "td",
              {},
              preview.fits
                ? el(
                    "button",
                    {
                      class: "small",
                      onclick: () => place(store, row.id, placementOption(list[i])),
                    },
                    "Place",
                  )
                : null,
              disaggregatedOption(list[i])
                ? el(
                    "button",
                    {
                      class: "small",
                      title: "decode here, prefill long prompts on the faster node",
                      onclick: () => place(store, row.id, disaggregatedOption(list[i])),
                    },
                    "Place with prefill there",
                  )
                : null,
            ),
          ),
        ),
      ),
    ),
  );
}

function modelRow(store, row) {
  const list = previewsFor(store, row.id);
  const fit = fitSummary(store.state, list);
  const onThisNode = row.downloadedOn.some((place) => place.nodeId === store.nodeId);
  const downloaded = row.downloadedOn.length
    ? `on ${row.downloadedOn.map((p) => p.node + (p.partial ? " (part)" : "")).join(", ")}`
    : "not downloaded";
  const placing = Boolean(store.placing[row.id]);
  const actions = [];
  if (row.instances.length === 0 && fit.option && !placing) {
    actions.push(el("button", { class: "small primary", onclick: () => place(store, row.id, fit.option) }, "Place"));
  }
  if (!onThisNode && store.nodeId) {
    actions.push(el("button", { class: "small", onclick: () => startDownload(store, row.id, store.nodeId) }, "Download"));
  }
  if (row.custom && row.instances.length === 0 && row.downloadedOn.length === 0) {
    actions.push(el("button", { class: "small danger", onclick: () => removeCard(store, row.id) }, "Remove"));
  }
  for (const instance of row.instances) {
    actions.push(el("button", { class: "small danger", onclick: () => deleteInstance(store, instance.instanceId) }, "Stop"));
  }
  actions.push(
    el(
      "button",
      {
        class: "small",
        "aria-expanded": String(open === row.id),
        onclick: () => {
          open = open === row.id ? null : row.id;
          store.render();
        },
      },
      open === row.id ? "Hide options" : "Options",
    ),
  );
  return el(
    "div",
    { class: "model-row", "data-model": row.id },
    el(
      "div",
      { class: "model-main" },
      el("div", { class: "title" }, el("span", { class: "model-id" }, row.id)),
      el(
        "div",
        { class: "tags" },
        row.family !== "-" ? badge(row.family) : null,
        row.quantization ? badge(row.quantization) : null,
        ...row.capabilities.filter((c) => c !== "text").map((c) => badge(c, "cap")),
        row.dialect !== "none" ? badge(`reasoning: ${row.dialect}`, "cap") : null,
        row.serving ? badge("serving", "ok") : row.instances.length ? badge("starting") : null,
        placing ? badge("placing…") : null,
      ),
      el(
        "div",
        { class: "muted" },
        `${row.size} · ${row.layers} layers${row.contextLength ? ` · ${row.contextLength.toLocaleString("en")} context` : ""} · ${downloaded}`,
      ),
      el("div", { class: fit.fits === false ? "fit no" : fit.fits ? "fit yes" : "fit" }, fit.text),
    ),
    el("div", { class: "model-actions" }, ...actions),
    open === row.id ? el("div", { class: "model-options" }, optionsTable(store, row, list)) : null,
  );
}

export function renderModels(store) {
  const rows = catalogRows(store.cards, store.state, $("model-search").value, $("model-show").value);
  const visible = rows.slice(0, shown);
  const key = [visible, rows.length, open, Object.keys(store.placing), visible.map((r) => previews.get(r.id)?.at ?? 0), store.nodeId];
  renderInto($("catalog"), key, () => [
    ...(rows.length ? visible.map((row) => modelRow(store, row)) : [el("p", { class: "muted" }, "No model matches.")]),
    rows.length > visible.length
      ? el("button", { type: "button", class: "more", onclick: () => {
          shown += PAGE_ROWS;
          store.render();
        } }, `Show more (${rows.length - visible.length} left)`)
      : null,
  ]);
  const dirs = modelDirs(store.state);
  renderInto($("model-dirs"), dirs, () =>
    dirs.length
      ? dirs.map((dir) =>
          el(
            "div",
            { class: "card wide" },
            el("div", { class: "title" }, el("span", { class: "path" }, dir.dir), dir.readOnly ? badge("read-only") : null),
            el("div", { class: "muted" }, `${dir.node} · ${dir.models.length} model${dir.models.length === 1 ? "" : "s"}: ${dir.models.join(", ")}`),
          ),
        )
      : [el("p", { class: "muted" }, "No node has found a model on disk yet.")],
  );
}

async function searchHub(store, event) {
  event.preventDefault();
  const query = $("hub-query").value.trim();
  const results = $("hub-results");
  results.replaceChildren(el("p", { class: "muted" }, `searching the hub for ${query}…`));
  const response = await store.api(`/models/search?${new URLSearchParams({ q: query, limit: "10" })}`);
  if (!response.ok) {
    results.replaceChildren(el("p", { class: "error" }, await apiError(response)));
    return;
  }
  const found = await response.json();
  results.replaceChildren(
    ...(found.length === 0 ? [el("p", { class: "muted" }, "Nothing on the hub matches.")] : []),
    ...found.map((model) =>
      el(
        "div",
        { class: "hub-row", "data-model": model.id },
        el("span", { class: "model-id" }, model.id),
        el("span", { class: "muted" }, `${model.downloads.toLocaleString("en")} downloads`),
        el("button", { class: "small primary", onclick: () => addFromHub(store, model.id) }, model.known ? "Download" : "Add and download"),
      ),
    ),
  );
}

// A card for the hub model (read from its config.json), then its download on this node.
async function addFromHub(store, modelId) {
  message(`reading ${modelId} from the hub…`);
  const response = await store.api("/models/add", { method: "POST", headers: JSON_HEADERS, body: JSON.stringify({ model_id: modelId }) });
  if (!response.ok) {
    message(await apiError(response));
    return;
  }
  const card = await response.json();
  // The card reaches State a moment after the command; the download needs it there.
  for (let tries = 0; tries < 20 && !store.cards.some((c) => c.model_id === card.model_id); tries += 1) {
    await new Promise((resolve) => setTimeout(resolve, 250));
    await store.loadCards();
  }
  await startDownload(store, card.model_id, store.nodeId);
  $("model-search").value = card.model_id;
  message(`added ${card.model_id}: ${card.n_layers} layers, ${formatBytes(card.storage_size.in_bytes)}; downloading on ${nodeName(store.state, store.nodeId)}`);
  store.render();
}

export function setupModels(store) {
  $("model-search").addEventListener("input", () => {
    shown = PAGE_ROWS;
    store.render();
  });
  $("model-show").addEventListener("change", () => store.render());
  $("hub-form").addEventListener("submit", (event) => searchHub(store, event));
  store.api("/node_id").then(async (response) => {
    if (response.ok) store.nodeId = await response.json();
  });
}
