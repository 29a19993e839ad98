// NodeCard rendered for real (Svelte's server renderer): a node whose instances have a prefix cache shows
// its token hit rate and the bytes each tier holds against its budget; a node without one shows nothing.
import { render } from "svelte/server";
import { describe, expect, it } from "vitest";

import type { ChatStore } from "../lib/chat.svelte";
import { appContext } from "../lib/context";
import { emptyState } from "../lib/reducer";
import type { Session } from "../lib/session.svelte";
import type { NodeView, PrefixCacheView } from "../lib/types";
import type { UI } from "../lib/ui.svelte";
import NodeCard from "./NodeCard.svelte";

const MB = 1024 ** 2;
const GB = 1024 ** 3;

const node = (prefix_cache: PrefixCacheView | null): NodeView =>
  ({
    id: "n1",
    name: "studio",
    self: true,
    host: null,
    api_port: 52415,
    grpc_port: 52416,
    version: "0.1.0",
    namespace: "",
    memory_total_bytes: 16 * GB,
    memory_available_bytes: 8 * GB,
    chip: "Apple M4",
    backend: "metal",
    disk_free_bytes: 100 * GB,
    platform: "macOS",
    cpu_count: 10,
    uptime_s: 1,
    secured: false,
    models: [],
    instances: [],
    last_seen_s: 0,
    rtt_ms: 0,
    source: "static",
    prefix_cache,
  }) as NodeView;

function renderCard(view: NodeView): string {
  const session = { state: emptyState(), api: null } as unknown as Session;
  const context = appContext({ session, chat: null as unknown as ChatStore, ui: null as unknown as UI });
  return render(NodeCard, { props: { node: view }, context }).body;
}

describe("NodeCard", () => {
  it("shows the node's prefix cache: hit rate and bytes per tier against their budgets", () => {
    const html = renderCard(
      node({
        lookups: 12,
        hits: 11,
        prompt_tokens: 40000,
        cached_tokens: 33400,
        token_hit_rate: 0.835,
        ram_bytes: 26 * MB,
        ram_budget_bytes: 2 * GB,
        disk_bytes: 28 * MB,
        disk_budget_bytes: 16 * GB,
        ram_evictions: 0,
        disk_evictions: 0,
        failures: 0,
      }),
    );
    const line = html.match(/<p[^>]*aria-label="Prefix cache"[^>]*>([\s\S]*?)<\/p>/)?.[1] ?? "";
    const text = line.replace(/<[^>]*>/g, "").replace(/\s+/g, " ");
    expect(text).toContain("84% of prompt tokens cached");
    expect(text).toContain("RAM 26.0 MB / 2.00 GB");
    expect(text).toContain("disk 28.0 MB / 16.0 GB");
    expect(line).toContain("33400 of 40000 prompt tokens restored; 11 of 12 requests hit");
  });

  it("shows the prefix cache's failures, only when there were some", () => {
    const figures = {
      lookups: 3, hits: 1, prompt_tokens: 900, cached_tokens: 300, token_hit_rate: 0.333, ram_bytes: MB,
      ram_budget_bytes: GB, disk_bytes: 0, disk_budget_bytes: 0, ram_evictions: 0, disk_evictions: 0,
    };
    const line = (html: string) =>
      (html.match(/<p[^>]*aria-label="Prefix cache"[^>]*>([\s\S]*?)<\/p>/)?.[1] ?? "").replace(/<[^>]*>/g, "");
    expect(line(renderCard(node({ ...figures, failures: 2 })))).toContain("2 failures");
    expect(line(renderCard(node({ ...figures, failures: 0 })))).not.toContain("failure");
  });

  it("shows no prefix cache line for a node without one", () => {
    expect(renderCard(node(null))).not.toContain("Prefix cache");
  });
});
