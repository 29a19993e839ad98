// Numbers as people read them. Every function takes what the API sends and returns display text.

import type { InstanceDownload, MTPStats, StreamTiming } from "./types";

const UNITS = ["B", "KB", "MB", "GB", "TB", "PB"];

/** 1536 -> "1.5 KB" (binary multiples, shown with the usual short names). */
export function formatBytes(bytes: number | null | undefined): string {
  if (bytes == null || !Number.isFinite(bytes)) return "—";
  const sign = bytes < 0 ? "-" : "";
  let value = Math.abs(bytes);
  let unit = 0;
  while (value >= 1024 && unit < UNITS.length - 1) {
    value /= 1024;
    unit += 1;
  }
  const digits = unit === 0 || value >= 100 ? 0 : value >= 10 ? 1 : 2;
  return `${sign}${value.toFixed(digits)} ${UNITS[unit]}`;
}

/** 0.8349 -> "83%"; null -> "—". */
export function formatPercent(fraction: number | null | undefined): string {
  if (fraction == null || !Number.isFinite(fraction)) return "—";
  return `${Math.round(fraction * 100)}%`;
}

/** Milliseconds: "72 ms", "1.4 s", "2 min 5 s". */
export function formatDuration(ms: number | null | undefined): string {
  if (ms == null || !Number.isFinite(ms) || ms < 0) return "—";
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = ms / 1000;
  if (s < 60) return `${s.toFixed(s < 10 ? 1 : 0)} s`;
  const minutes = Math.floor(s / 60);
  return `${minutes} min ${Math.round(s - minutes * 60)} s`;
}

export function formatRate(tokensPerSecond: number | null | undefined): string {
  if (tokensPerSecond == null || !Number.isFinite(tokensPerSecond) || tokensPerSecond <= 0) return "—";
  return `${tokensPerSecond.toFixed(tokensPerSecond < 10 ? 2 : 1)} tok/s`;
}

/** An instance's weights on their way: "25% · 1.00 GB of 4.00 GB · 12 s left". */
export function formatInstanceDownload(d: InstanceDownload): string {
  const done = d.bytes_total > 0 ? d.bytes_done / d.bytes_total : 0;
  const left = d.eta_s != null ? ` · ${formatDuration(d.eta_s * 1000)} left` : "";
  return `${formatPercent(done)} · ${formatBytes(d.bytes_done)} of ${formatBytes(d.bytes_total)}${left}`;
}

/** Layers [start, end) as people count them: "layers 0–7". */
export function formatLayers(start: number, end: number): string {
  return end - start === 1 ? `layer ${start}` : `layers ${start}–${end - 1}`;
}

/** A tensor group's member: its share of every layer. */
export function formatSlice(rank: number, members: number): string {
  return `every layer, slice ${rank + 1}/${members}`;
}

/** An estimated decode speed, and what it rests on. */
export function formatEstimate(tokensPerS: number | null, basis: string | null): string {
  if (tokensPerS == null) return "—";
  const speed = tokensPerS >= 100 ? tokensPerS.toFixed(0) : tokensPerS >= 10 ? tokensPerS.toFixed(1) : tokensPerS.toFixed(2);
  return `≈ ${speed} tok/s${basis === "nominal" ? " (nominal speeds)" : ""}`;
}

/** What a message shows under its text: the speed, and what native MTP did. */
export function formatStats(stats: MTPStats): string[] {
  const parts = [
    `${stats.completion_tokens} tokens`,
    formatRate(stats.decode_tokens_per_s),
    `TTFT ${formatDuration(stats.ttft_ms)}`,
  ];
  if (!stats.enabled) {
    parts.push(`MTP off${stats.reason ? `: ${stats.reason}` : ""}`);
  } else if (stats.drafted_tokens === 0) {
    parts.push(`MTP K=0, acceptance —${stats.reason ? ` (${stats.reason})` : ""}`);
  } else {
    parts.push(`MTP K=${stats.k}${stats.k_fixed ? "" : " (adaptive)"}`);
    parts.push(`acceptance ${formatPercent(stats.acceptance_rate)}`);
    parts.push(`${stats.accepted_tokens}/${stats.drafted_tokens} drafts accepted`);
  }
  return parts;
}

/** What a reply without the server's stats (stopped, failed) shows: what the browser measured of its
 * stream. "≥": a piece of the stream carries one token or more. */
export function formatTiming(timing: StreamTiming): string[] {
  const rate = timing.chunks > 1 && timing.streamMs > 0 ? (timing.chunks - 1) / (timing.streamMs / 1000) : null;
  return [
    `≥${timing.chunks} ${timing.chunks === 1 ? "token" : "tokens"}`,
    rate === null ? "tok/s —" : `≥${formatRate(rate)}`,
    `TTFT ${formatDuration(timing.ttftMs)}`,
  ];
}

/** "3 s ago", "5 min ago" from a unix time in seconds. */
export function formatAgo(unixSeconds: number, now: number = Date.now() / 1000): string {
  const s = Math.max(0, now - unixSeconds);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${Math.round(s / 3600)} h ago`;
  return `${Math.round(s / 86400)} d ago`;
}

export function formatContext(tokens: number | null | undefined): string {
  if (tokens == null) return "—";
  return tokens >= 1024 ? `${Math.round(tokens / 1024)}K ctx` : `${tokens} ctx`;
}
