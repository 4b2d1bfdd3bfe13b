// Runs the dashboard's keyedFetch (view.mjs) against a real node started with --api-key,
// with Node's fetch, a Map standing in for localStorage and scripted answers for the
// browser's prompt; prints what happened, for tests/api/test_api_keys.py.
import { pathToFileURL } from "node:url";

const [viewPath, base, key] = process.argv.slice(2);
const view = await import(pathToFileURL(viewPath).href);

class Storage {
  constructor() {
    this.items = new Map();
  }
  getItem(name) {
    return this.items.has(name) ? this.items.get(name) : null;
  }
  setItem(name, value) {
    this.items.set(name, String(value));
  }
}

const get = (path, options) => fetch(base + path, options);
const storage = new Storage();
const asked = [];
const api = view.keyedFetch(get, storage, async (refused) => {
  asked.push(refused);
  await new Promise((resolve) => setTimeout(resolve, 50));
  return key;
});
const first = await Promise.all([api("/state"), api("/v1/models"), api("/instance/previews?model_id=acme/tiny")]);
const stored = storage.getItem("exo-api-key");

let askedLater = 0;
const reloaded = view.keyedFetch(get, storage, () => {
  askedLater++;
  return null;
});
const later = [await api("/state"), await reloaded("/state")];

// A wrong key kept from before: asked again, shown which was refused.
const refusedStorage = new Storage();
refusedStorage.setItem("exo-api-key", "wrong-" + key);
let refusedShown = null;
const afterRefusal = await view.keyedFetch(get, refusedStorage, (refused) => {
  refusedShown = refused;
  return key;
})("/state");

let askedWhenDeclined = 0;
const declining = view.keyedFetch(get, new Storage(), () => {
  askedWhenDeclined++;
  return null;
});
const declined = [await declining("/state"), await declining("/state")];

console.log(
  JSON.stringify({
    first: first.map((r) => r.status),
    asked,
    stored,
    later: later.map((r) => r.status),
    askedLater,
    afterRefusal: afterRefusal.status,
    refusedShown: refusedShown?.startsWith("wrong-") ? "wrong-" : refusedShown,
    declined: declined.map((r) => r.status),
    askedWhenDeclined,
  }),
);
