// Runs the dashboard's view functions on a real node's JSON (read from the file given as
// the first argument) and prints what the dashboard would show, for test_dashboard.py.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [inputPath, viewPath, markdownPath] = process.argv.slice(2);
const view = await import(pathToFileURL(viewPath).href);
const markdown = await import(pathToFileURL(markdownPath).href);
const { state, twinState, previews, stream, cards, markdownSamples } = JSON.parse(readFileSync(inputPath, "utf8"));

// Feed the stream in small pieces, as a browser's reader hands it over.
let reply = {};
let buffer = "";
for (let i = 0; i < stream.length; i += 7) {
  const parsed = view.parseSse(buffer + stream.slice(i, i + 7));
  buffer = parsed.rest;
  for (const event of parsed.events) reply = view.foldChatStream(reply, event);
}

// The real node copied to 1..6 nodes, all linked both ways: no link line may cross a label.
const [nodeId] = Object.keys(state.nodes);
const crossings = {};
for (let count = 1; count <= 6; count += 1) {
  const ids = [nodeId, ...Array.from({ length: count - 1 }, (_, i) => `${i}0000000${nodeId.slice(8)}`)];
  const nodes = Object.fromEntries(ids.map((id, i) => [id, { ...state.nodes[nodeId], nodeId: id, friendlyName: `node-${i}-with-a-long-name` }]));
  const connections = ids.flatMap((a) => ids.filter((b) => b !== a).map((b) => ({ source: a, sink: b, sinkIp: "10.0.0.1", latencyMs: 1.25 })));
  const layout = view.topologyLayout({ ...state, nodes, topology: { connections } });
  const [minX, minY, width, height] = layout.viewBox;
  const inside = (box) => box.x >= minX && box.y >= minY && box.x + box.width <= minX + width && box.y + box.height <= minY + height;
  crossings[count] = {
    edges: layout.edges.length,
    crossed: layout.edges.flatMap((e) =>
      layout.nodes.filter((n) => view.segmentCrossesBox(e.x1, e.y1, e.x2, e.y2, n.label.box)).map((n) => n.name),
    ),
    outside: layout.nodes.filter((n) => !inside(n.label.box)).map((n) => n.name),
  };
}

const conversation = {
  messages: [
    { role: "user", content: "hi" },
    { role: "assistant", model: "m", content: "Hello", reasoning: "The user greets." },
    { role: "user", content: "look", images: ["data:image/png;base64,AAAA"] },
    { role: "assistant", model: "m", content: "", error: "stopped" },
    { role: "user", content: "weather?" },
    {
      role: "assistant",
      model: "m",
      content: "Let me check.",
      reasoning: "Paris.",
      toolCalls: [
        { id: "call_abc", name: "get_weather", arguments: '{"city": "Paris"}' },
        { name: "get_time", arguments: "{}" },
      ],
    },
    { role: "user", content: "again" },
    { role: "assistant", model: "m", content: "", error: "stopped", toolCalls: [{ name: "get_weather", arguments: '{"ci' }] },
    { role: "assistant", model: "m", content: "Hm", error: "stopped", toolCalls: [{ name: "get_weather", arguments: '{"ci' }] },
  ],
};

// A reply's two calls, one answered by the user: the other is still pending.
const toolRound = {
  messages: [
    { role: "user", content: "weather and time?" },
    {
      role: "assistant",
      model: "m",
      content: "",
      reasoning: "Two tools.",
      toolCalls: [
        { id: "call_w", name: "get_weather", arguments: '{"city": "Paris"}' },
        { name: "get_time", arguments: "{}" },
      ],
    },
    { role: "tool", toolCallId: "call_w", name: "get_weather", content: "sunny" },
  ],
};

console.log(
  JSON.stringify({
    nodes: view.nodeRows(state),
    twinNodes: view.nodeRows(twinState),
    twinTopology: view.topologyLayout(twinState, 300),
    crossings,
    links: view.linkRows(state),
    instances: view.instanceRows(state),
    serving: view.servingModels(state),
    summary: view.clusterSummary(state),
    downloads: view.downloadRows(state),
    previews: view.previewRows(state, previews),
    gpuPreviews: view.previewRows(state, [{ ...previews[0], memoryKind: { [nodeId]: "gpu" } }]),
    disaggregatedOptions: [true, false].map((worthIt) =>
      view.disaggregatedOption({ ...previews[0], disaggregation: { worthIt, prefillNode: "p", decodeNode: nodeId } }),
    ),
    disaggregatedPreviews: view.previewRows(state, [
      { ...previews[0], disaggregation: { worthIt: true, prefillNode: nodeId, promptTokens: 8192, ttftAloneSeconds: 4.684, ttftSeconds: 1.337 } },
      { ...previews[0], disaggregation: { worthIt: false, prefillNode: nodeId, promptTokens: 8192, ttftAloneSeconds: 4.684, ttftSeconds: null } },
    ]),
    fit: view.fitSummary(state, previews),
    catalog: view.catalogRows(cards, state, "tiny", "all"),
    downloadedCatalog: view.catalogRows(cards, state, "", "downloaded").map((r) => r.id),
    dirs: view.modelDirs(state),
    opencode: view.opencodeConfig("http://host:52415", cards),
    requestMessages: view.requestMessages(conversation),
    pendingAfterStop: view.pendingToolCalls(conversation),
    toolRoundMessages: view.requestMessages(toolRound),
    toolRoundPending: view.pendingToolCalls(toolRound),
    toolRoundAnswered: view.pendingToolCalls({
      messages: [...toolRound.messages, { role: "tool", toolCallId: "call_1_1", name: "get_time", content: "noon" }],
    }),
    toolRoundAsked: view.pendingToolCalls({ messages: [...toolRound.messages, { role: "user", content: "never mind" }] }),
    markdown: markdownSamples.map((sample) => markdown.renderMarkdown(sample)),
    reply,
    leftover: buffer,
  }),
);
