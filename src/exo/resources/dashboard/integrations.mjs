// The Integrations page: copy-paste configs for opencode, Claude Code, Codex and Open
// WebUI, pointing at this node and listing the models the cluster serves now.
import { $, copyButton, el, renderInto, renderOptions } from "./dom.mjs";
import { claudeCodeEnv, codexConfig, opencodeConfig, openWebUiConfig, servingModels } from "./view.mjs";

// One block per line, wrapping under its own indentation plus two: on a phone a long
// `export` line reads as one command continued, not as two, and nothing needs scrolling.
function codeLines(text) {
  return text.split("\n").map((line) => {
    const hang = line.length - line.trimStart().length + 2;
    return el("span", { class: "line", style: `padding-left: ${hang}ch; text-indent: -${hang}ch` }, line);
  });
}

function block(name, where, text, id) {
  return el(
    "div",
    { class: "panel integration", id: `integration-${id}` },
    el("div", { class: "title" }, el("h2", {}, name), copyButton(() => text)),
    el("p", { class: "muted" }, where),
    el("pre", { class: "code config" }, el("code", {}, codeLines(text))),
  );
}

export function renderIntegrations(store) {
  const base = window.location.origin;
  const key = window.localStorage.getItem("exo-api-key") ?? "";
  const serving = servingModels(store.state);
  const select = $("integration-model");
  renderOptions(select, serving);
  const model = select.value || "<model id>";
  const cards = serving.map((id) => store.cards.find((card) => card.model_id === id) ?? { model_id: id });
  $("integrations-intro").textContent = serving.length
    ? `Each config points at this node (${base}) and lists the ${serving.length} model${serving.length === 1 ? "" : "s"} the cluster serves now.`
    : `No model serves yet: place one on the Models page and it shows up here. Each config points at this node (${base}).`;
  const opencode = JSON.stringify(opencodeConfig(base, cards, key), null, 2);
  renderInto($("integrations"), [base, key, serving, model, cards.map((c) => c.reasoning_dialect)], () => [
    block("opencode", "~/.config/opencode/opencode.json, then: opencode -m exo/<model>", opencode, "opencode"),
    block("Claude Code", "In the shell you start claude from (the Claude Messages API):", claudeCodeEnv(base, model, key), "claude"),
    block("Codex", "~/.codex/config.toml (the Responses API):", codexConfig(base, model, key), "codex"),
    block(
      "Open WebUI",
      "An OpenAI connection and an Ollama connection, in its settings or its environment:",
      openWebUiConfig(base, key),
      "openwebui",
    ),
  ]);
}

export function setupIntegrations(store) {
  $("integration-model").addEventListener("change", () => renderIntegrations(store));
}
