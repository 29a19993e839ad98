// Model output as HTML, safely: markdown-it with raw HTML off escapes every tag the model writes, and
// its link check drops javascript:, vbscript:, file: and data: URLs. Links open in a new tab. Images
// stay text: a reply must not make the browser fetch from elsewhere.

import MarkdownIt from "markdown-it";

const md = new MarkdownIt({ html: false, linkify: false, breaks: true, typographer: false }).disable("image");

const defaultLinkOpen =
  md.renderer.rules.link_open ?? ((tokens, idx, options, _env, self) => self.renderToken(tokens, idx, options));

md.renderer.rules.link_open = (tokens, idx, options, env, self) => {
  tokens[idx].attrSet("target", "_blank");
  tokens[idx].attrSet("rel", "noopener noreferrer nofollow");
  return defaultLinkOpen(tokens, idx, options, env, self);
};

export function renderMarkdown(text: string): string {
  return md.render(text);
}

const LIST_ITEM = /^\s*([-*+]|\d+[.)])\s/;

/** Code with no fences around it (small models answer like that): markdown would collapse its
 * indentation, so such a reply is shown as plain text. Two or more indented lines that are not nested
 * list items, and no fence anywhere. */
export function looksLikeBareCode(text: string): boolean {
  if (text.includes("```") || text.includes("~~~")) return false;
  const indented = text.split("\n").filter((line) => /^(\t| {2,})\S/.test(line) && !LIST_ITEM.test(line));
  return indented.length >= 2;
}
