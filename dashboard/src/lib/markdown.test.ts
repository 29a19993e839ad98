import { describe, expect, it } from "vitest";

import { looksLikeBareCode, renderMarkdown } from "./markdown";

describe("renderMarkdown", () => {
  it("renders markdown and fenced code", () => {
    const html = renderMarkdown("**bold** and `x`\n\n```python\nprint('<hi>')\n```");
    expect(html).toContain("<strong>bold</strong>");
    expect(html).toContain("<code>x</code>");
    expect(html).toContain('<pre><code class="language-python">print(\'&lt;hi&gt;\')\n</code></pre>');
  });

  it.each([
    ["<script>alert(1)</script>", "<script"],
    ['<img src=x onerror="alert(1)">', "<img"],
    ['<a href="javascript:alert(1)">x</a>', "<a "],
    ["<iframe src=//evil></iframe>", "<iframe"],
    ['<div style="position:fixed">x</div>', "<div"],
  ])("escapes raw HTML from the model: %s", (input, forbidden) => {
    const html = renderMarkdown(input);
    expect(html).not.toContain(forbidden);
    expect(html).toContain("&lt;");
  });

  it.each(["javascript:alert(1)", "JaVaScRiPt:alert(1)", "vbscript:msgbox(1)", "data:text/html;base64,PHNjcmlwdD4="])(
    "drops dangerous link targets: %s",
    (url) => {
      const html = renderMarkdown(`[click](${url})`);
      expect(html).not.toContain("href");
    },
  );

  it("opens links in a new tab without handing over the page", () => {
    expect(renderMarkdown("[exo](https://example.com/x)")).toContain(
      '<a href="https://example.com/x" target="_blank" rel="noopener noreferrer nofollow">exo</a>',
    );
  });

  it("leaves images as text (no request to elsewhere)", () => {
    expect(renderMarkdown("![pixel](https://tracker.example/p.png)")).not.toContain("<img");
  });
});

describe("looksLikeBareCode", () => {
  it("spots code without fences", () => {
    expect(looksLikeBareCode("def add(a, b):\n    x = a\n    return x + b\n")).toBe(true);
    expect(looksLikeBareCode("int main() {\n\treturn 0;\n\t}\n")).toBe(true);
  });

  it("leaves prose, nested lists and fenced code to markdown", () => {
    expect(looksLikeBareCode("Here is how.\n\nFirst, this.\nThen that.")).toBe(false);
    expect(looksLikeBareCode("- fruit\n  - apple\n  - pear\n  1. first")).toBe(false);
    expect(looksLikeBareCode("Like so:\n```py\ndef f():\n    x = 1\n    return x\n```")).toBe(false);
    expect(looksLikeBareCode("one line\n    indented once")).toBe(false);
  });
});
