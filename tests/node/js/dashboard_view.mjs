// Runs the dashboard's view functions on a real node's JSON (read from the file given as
// the first argument) and prints what the dashboard would show, for test_dashboard.py.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [inputPath, viewPath] = process.argv.slice(2);
const view = await import(pathToFileURL(viewPath).href);
const { state, twinState, previews, stream } = JSON.parse(readFileSync(inputPath, "utf8"));

// Feed the stream in small pieces, as a browser's reader hands it over.
let reply = {};
let buffer = "";
for (let i = 0; i < stream.length; i += 7) {
  const parsed = view.parseSse(buffer + stream.slice(i, i + 7));
  buffer = parsed.rest;
  for (const event of parsed.events) reply = view.foldChatStream(reply, event);
}

console.log(
  JSON.stringify({
    nodes: view.nodeRows(state),
    twinNodes: view.nodeRows(twinState),
    twinTopology: view.topologyLayout(twinState, 300),
    links: view.linkRows(state),
    instances: view.instanceRows(state),
    serving: view.servingModels(state),
    downloads: view.downloadRows(state),
    previews: view.previewRows(state, previews),
    reply,
    leftover: buffer,
  }),
);
