import { describe, expect, it } from "vitest";

import {
  formatAgo,
  formatBytes,
  formatDuration,
  formatInstanceDownload,
  formatEstimate,
  formatLayers,
  formatSlice,
  formatPercent,
  formatRate,
  formatStats,
  formatTiming,
} from "./format";
import type { MTPStats } from "./types";

describe("formatting", () => {
  it.each([
    [0, "0 B"],
    [1023, "1023 B"],
    [1536, "1.50 KB"],
    [25276510208, "23.5 GB"],
    [512 * 1024 ** 3, "512 GB"],
    [-2 * 1024 ** 2, "-2.00 MB"],
    [null, "—"],
    [Number.NaN, "—"],
  ])("bytes %s -> %s", (value, text) => expect(formatBytes(value)).toBe(text));

  it("percent, duration, rate, layers, age", () => {
    expect(formatPercent(0.8349)).toBe("83%");
    expect(formatPercent(1)).toBe("100%");
    expect(formatPercent(null)).toBe("—");
    expect(formatDuration(72.4)).toBe("72 ms");
    expect(formatDuration(1432)).toBe("1.4 s");
    expect(formatDuration(125_000)).toBe("2 min 5 s");
    expect(formatRate(71.445)).toBe("71.4 tok/s");
    expect(formatRate(3.14159)).toBe("3.14 tok/s");
    expect(formatRate(0)).toBe("—");
    expect(formatLayers(0, 8)).toBe("layers 0–7");
    expect(formatLayers(4, 5)).toBe("layer 4");
    expect(formatSlice(1, 2)).toBe("every layer, slice 2/2");
    expect(formatAgo(100, 130)).toBe("30 s ago");
    expect(formatAgo(0, 7200)).toBe("2 h ago");
  });

  it("an estimated speed says when it rests on nominal speeds", () => {
    expect(formatEstimate(123.4, "measured")).toBe("≈ 123 tok/s");
    expect(formatEstimate(12.34, "nominal")).toBe("≈ 12.3 tok/s (nominal speeds)");
    expect(formatEstimate(1.234, "measured")).toBe("≈ 1.23 tok/s");
    expect(formatEstimate(null, null)).toBe("—");
  });
});

const stats = (over: Partial<MTPStats>): MTPStats => ({
  enabled: true,
  reason: null,
  k: 2,
  k_fixed: true,
  k_histogram: {},
  rounds: 30,
  drafted_tokens: 60,
  accepted_tokens: 29,
  acceptance_rate: 0.4833,
  per_position_acceptance: [],
  ttft_ms: 72.004,
  decode_tokens_per_s: 71.445,
  prompt_tokens: 20,
  completion_tokens: 60,
  ...over,
});

describe("formatInstanceDownload", () => {
  const d = { id: "d1", status: "downloading", files_done: 1, files_total: 4, speed_bytes_per_s: 0, elapsed_s: 3 };
  it("says how far the weights are, and how long is left when known", () => {
    expect(formatInstanceDownload({ ...d, bytes_done: 2 ** 30, bytes_total: 4 * 2 ** 30, eta_s: 12 })).toBe(
      "25% · 1.00 GB of 4.00 GB · 12 s left",
    );
    expect(formatInstanceDownload({ ...d, bytes_done: 0, bytes_total: 0, eta_s: null })).toBe("0% · 0 B of 0 B");
  });
});

describe("formatStats", () => {
  it("shows speed, TTFT, K and the acceptance rate of a speculative reply", () => {
    expect(formatStats(stats({}))).toEqual([
      "60 tokens",
      "71.4 tok/s",
      "TTFT 72 ms",
      "MTP K=2",
      "acceptance 48%",
      "29/60 drafts accepted",
    ]);
    expect(formatStats(stats({ k_fixed: false, acceptance_rate: 0.84 }))).toContain("MTP K=2 (adaptive)");
    expect(formatStats(stats({ k_fixed: false, acceptance_rate: 0.84 }))).toContain("acceptance 84%");
  });

  it("says why MTP did not run", () => {
    const off = formatStats(stats({ enabled: false, reason: "native MTP is disabled (PUT /v1/settings)", drafted_tokens: 0 }));
    expect(off.at(-1)).toBe("MTP off: native MTP is disabled (PUT /v1/settings)");
    const plain = formatStats(stats({ k: 0, drafted_tokens: 0, accepted_tokens: 0, reason: "drafting cannot pay off here" }));
    expect(plain.at(-1)).toBe("MTP K=0, acceptance — (drafting cannot pay off here)");
  });
});

describe("formatTiming", () => {
  it("shows what the browser measured of a stopped reply: pieces, their rate, TTFT", () => {
    expect(formatTiming({ ttftMs: 85, chunks: 41, streamMs: 2000 })).toEqual(["≥41 tokens", "≥20.0 tok/s", "TTFT 85 ms"]);
    expect(formatTiming({ ttftMs: 1400, chunks: 1, streamMs: 0 })).toEqual(["≥1 token", "tok/s —", "TTFT 1.4 s"]);
  });
});
