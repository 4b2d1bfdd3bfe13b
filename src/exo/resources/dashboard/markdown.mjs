// A small Markdown renderer for chat replies: fenced code blocks, headings, lists, quotes,
// paragraphs, inline code, bold, italics and http(s) links. Everything is HTML-escaped
// first, so a reply can never inject markup; an unclosed fence (a reply still streaming)
// renders as a code block to the end.

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function inline(text) {
  const codes = [];
  // Inline code first, kept aside so nothing inside it is read as emphasis or a link.
  let html = escapeHtml(text).replace(/`([^`]+)`/g, (_, code) => {
    codes.push(code);
    return `\u0000${codes.length - 1}\u0000`;
  });
  html = html
    .replace(/\[([^\]]+)\]\((https?:\/\/[^\s)]+)\)/g, '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>')
    .replace(/\*\*([^*]+)\*\*/g, "<strong>$1</strong>")
    .replace(/(^|[^\w*])\*([^*\s][^*]*)\*(?!\w)/g, "$1<em>$2</em>")
    .replace(/(^|[^\w])_([^_\s][^_]*)_(?!\w)/g, "$1<em>$2</em>");
  return html.replace(/\u0000(\d+)\u0000/g, (_, i) => `<code>${codes[Number(i)]}</code>`);
}

const FENCE = /^\s*```\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const BULLET = /^\s*[-*+]\s+(.*)$/;
const NUMBERED = /^\s*\d+[.)]\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;

function codeBlock(language, lines) {
  const cls = language ? ` class="language-${escapeHtml(language)}"` : "";
  const label = language ? `<span class="code-lang">${escapeHtml(language)}</span>` : "";
  return `<pre class="code">${label}<code${cls}>${escapeHtml(lines.join("\n"))}</code></pre>`;
}

export function renderMarkdown(text) {
  const lines = (text ?? "").replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = FENCE.exec(line);
    if (fence) {
      const body = [];
      i += 1;
      while (i < lines.length && !FENCE.test(lines[i])) body.push(lines[i++]);
      i += 1; // the closing fence, if any
      out.push(codeBlock(fence[1], body));
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const level = Math.min(heading[1].length + 2, 6); // replies' headings sit below the page's
      out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
      i += 1;
      continue;
    }
    const list = BULLET.test(line) ? ["ul", BULLET] : NUMBERED.test(line) ? ["ol", NUMBERED] : null;
    if (list) {
      const items = [];
      while (i < lines.length && list[1].test(lines[i])) items.push(`<li>${inline(list[1].exec(lines[i++])[1])}</li>`);
      out.push(`<${list[0]}>${items.join("")}</${list[0]}>`);
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && QUOTE.test(lines[i])) quoted.push(QUOTE.exec(lines[i++])[1]);
      out.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const paragraph = [];
    while (
      i < lines.length &&
      lines[i].trim() &&
      ![FENCE, HEADING, BULLET, NUMBERED, QUOTE].some((pattern) => pattern.test(lines[i]))
    ) {
      paragraph.push(inline(lines[i++]));
    }
    out.push(`<p>${paragraph.join("<br>")}</p>`);
  }
  return out.join("");
}
