// Small DOM helpers the dashboard's pages share.

export const $ = (id) => document.getElementById(id);

export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "html") node.innerHTML = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined && child !== false) node.append(child);
  }
  return node;
}

const SVG = "http://www.w3.org/2000/svg";

export function svg(tag, attrs, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

export function bar(fraction) {
  const fill = el("div", { class: "fill" });
  fill.style.width = `${Math.round(100 * Math.min(Math.max(fraction, 0), 1))}%`;
  return el("div", { class: "bar", role: "progressbar", "aria-valuenow": Math.round(100 * fraction) }, fill);
}

export function badge(text, kind = "") {
  return el("span", { class: `badge ${kind}`.trim() }, text);
}

// Rebuilds `container` only when what it shows changed, so a poll does not replace a
// button under the pointer (a click would be lost) or reset a scroll position.
export function renderInto(container, key, build) {
  const text = JSON.stringify(key);
  if (container.dataset.key === text) return;
  container.dataset.key = text;
  container.replaceChildren(...build().filter((child) => child !== null && child !== undefined));
}

// A select's options for `values` ([value, label] pairs or plain values), rebuilt only
// when they change and keeping the user's pick when it is still offered: a model that
// starts serving must not switch the chat to another one.
export function renderOptions(select, values) {
  const pairs = values.map((v) => (Array.isArray(v) ? v : [v, v]));
  const picked = select.value;
  renderInto(select, pairs, () => pairs.map(([value, label]) => el("option", { value }, label)));
  if (picked && select.value !== picked && pairs.some(([value]) => value === picked)) select.value = picked;
}

// The API answers errors in its own shape: {"error": {"message": ...}}.
export async function apiError(response) {
  try {
    const body = await response.json();
    return body.error?.message ?? body.detail ?? JSON.stringify(body);
  } catch {
    return `${response.status} ${response.statusText}`;
  }
}

// Copies text; a page served over plain http from another machine has no clipboard API,
// so a hidden textarea and execCommand stand in there.
export async function copyText(text) {
  if (navigator.clipboard && window.isSecureContext) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // fall through to the old way
    }
  }
  const area = el("textarea", { readonly: true, class: "offscreen" });
  area.value = text;
  document.body.append(area);
  area.select();
  const copied = document.execCommand("copy");
  area.remove();
  return copied;
}

export function copyButton(getText) {
  const button = el("button", { type: "button", class: "copy" }, "Copy");
  button.addEventListener("click", async () => {
    const copied = await copyText(getText());
    button.textContent = copied ? "Copied" : "Select and copy";
    setTimeout(() => {
      button.textContent = "Copy";
    }, 1500);
  });
  return button;
}
