import { describe, expect, it } from "vitest";

import { chatModels, instancesOn, liveInstancesOf, pipelineRoom, placementStages, sortedNodes, stagesOf } from "./cluster";
import { applyEvent, emptyState, type DashboardState } from "./reducer";
import type { InstanceView, ModelView, NodeView, PlacementView } from "./types";

const node = (id: string, name: string, over: Partial<NodeView> = {}): NodeView =>
  ({ id, name, self: false, models: [], instances: [], memory_total_bytes: 100, memory_available_bytes: 60, ...over }) as NodeView;

const instance = (id: string, model: string, nodeId: string, over: Partial<InstanceView> = {}): InstanceView =>
  ({
    id,
    model,
    node: nodeId,
    state: "ready",
    created: 1,
    shard: { start_layer: 0, end_layer: 8, rank: 0, world_size: 1 },
    ...over,
  }) as InstanceView;

const model = (id: string, status: ModelView["status"]): ModelView => ({ id, status, name: id }) as ModelView;

function replay(events: [string, unknown][]): DashboardState {
  return events.reduce((state, [type, data]) => applyEvent(state, type, data), emptyState());
}

describe("applyEvent", () => {
  const snapshot = {
    cluster: { node_id: "a", namespace: "default", name: "mac-a", version: "0.1.0" },
    nodes: [node("a", "mac-a", { self: true })],
    links: [],
    instances: [instance("i1", "exo-demo", "a", { state: "loading", progress: 0.2 })],
    settings: { native_mtp_enabled: true, sources: {}, env_overrides: {}, settings_file: "s.json" },
    models: [model("exo-demo", "local")],
  };

  it("holds the snapshot, then every change", () => {
    const state = replay([
      ["snapshot", snapshot],
      ["node.added", node("b", "mac-b")],
      ["links", [{ from: "a", to: "b", rtt_ms: 1, source: "static" }]],
      ["instance.updated", instance("i1", "exo-demo", "a", { state: "ready", progress: 1 })],
      ["instance.added", instance("i2", "big", "b")],
      ["settings", { ...snapshot.settings, native_mtp_enabled: false }],
      ["node.updated", node("b", "mac-b", { memory_available_bytes: 10 })],
    ]);
    expect(Object.keys(state.nodes)).toEqual(["a", "b"]);
    expect(state.nodes.b.memory_available_bytes).toBe(10);
    expect(state.instances.i1.state).toBe("ready");
    expect(state.instances.i2.node).toBe("b");
    expect(state.links).toHaveLength(1);
    expect(state.settings?.native_mtp_enabled).toBe(false);
  });

  it("forgets what was removed, and a new snapshot replaces everything (reconnect)", () => {
    const state = replay([
      ["snapshot", snapshot],
      ["node.added", node("b", "mac-b")],
      ["instance.added", instance("i2", "big", "b")],
      ["instance.removed", { id: "i2" }],
      ["node.removed", { id: "b" }],
    ]);
    expect(Object.keys(state.nodes)).toEqual(["a"]);
    expect(Object.keys(state.instances)).toEqual(["i1"]);
    const again = applyEvent(applyEvent(state, "node.added", node("c", "mac-c")), "snapshot", { ...snapshot, instances: [] });
    expect(Object.keys(again.nodes)).toEqual(["a"]);
    expect(again.instances).toEqual({});
  });

  it("follows this node's downloads", () => {
    const download = (status: string, bytes: number) => ({ id: "d1", model: "qwen3.5-2b-8bit", status, progress: { bytes_done: bytes } });
    const state = replay([
      ["snapshot", { ...snapshot, downloads: [download("downloading", 10)] }],
      ["download.updated", download("downloading", 99)],
      ["download.added", { ...download("queued", 0), id: "d2" }],
    ]);
    expect(state.downloads.d1.progress.bytes_done).toBe(99);
    expect(Object.keys(state.downloads)).toEqual(["d1", "d2"]);
    expect(Object.keys(applyEvent(state, "download.removed", { id: "d1" }).downloads)).toEqual(["d2"]);
    expect(replay([["snapshot", snapshot]]).downloads).toEqual({}); // an older daemon: none
  });

  it("ignores events it does not know (a newer daemon) without copying the state", () => {
    const state = replay([["snapshot", snapshot]]);
    expect(applyEvent(state, "gpu.temperature", { id: "x" })).toBe(state);
  });

  it("never changes the state it was given", () => {
    const state = replay([["snapshot", snapshot]]);
    const frozen = JSON.stringify(state);
    applyEvent(state, "node.added", node("b", "mac-b"));
    applyEvent(state, "instance.removed", { id: "i1" });
    expect(JSON.stringify(state)).toBe(frozen);
  });
});

describe("cluster selectors", () => {
  it("puts this node first, then the others by name", () => {
    const state = replay([["snapshot", { nodes: [node("z", "zeta"), node("y", "alpha"), node("s", "self", { self: true })] }]]);
    expect(sortedNodes(state).map((n) => n.name)).toEqual(["self", "alpha", "zeta"]);
  });

  it("gives a single-node instance one stage and a pipeline its stages", () => {
    expect(stagesOf(instance("i", "m", "a"))).toEqual([{ node: "a", start_layer: 0, end_layer: 8, rank: 0, state: "ready" }]);
    const pipeline = instance("p", "big", "a", {
      stages: [
        { node: "a", start_layer: 0, end_layer: 20, rank: 0, state: "ready" },
        { node: "b", start_layer: 20, end_layer: 48, rank: 1, state: "loading" },
      ],
    });
    const state = replay([["snapshot", { instances: [pipeline, instance("q", "small", "c")] }]]);
    expect(instancesOn(state, "b").map((i) => i.id)).toEqual(["p"]);
    expect(instancesOn(state, "c").map((i) => i.id)).toEqual(["q"]);
  });

  it("reads a placement's stages from its shards unless it lists stages", () => {
    const placement = {
      node: "a",
      shards: [
        { node_id: "a", start_layer: 0, end_layer: 10, rank: 0, world_size: 2 },
        { node_id: "b", start_layer: 10, end_layer: 24, rank: 1, world_size: 2 },
      ],
    } as PlacementView;
    expect(placementStages(placement).map((s) => [s.node, s.start_layer, s.end_layer])).toEqual([
      ["a", 0, 10],
      ["b", 10, 24],
    ]);
    const staged = { ...placement, stages: [{ node: "c", start_layer: 0, end_layer: 24, rank: 0 }] };
    expect(placementStages(staged).map((s) => s.node)).toEqual(["c"]);
  });

  it("sums a pipeline's stages and finds the one with the least room left", () => {
    const stages = [
      { node: "a", start_layer: 0, end_layer: 10, rank: 0, needed_bytes: 500, free_bytes: 2000 },
      { node: "b", start_layer: 10, end_layer: 24, rank: 1, needed_bytes: 700, free_bytes: 900 },
    ];
    expect(pipelineRoom(stages)).toEqual({ neededBytes: 1200, tightest: stages[1], leftBytes: 200 });
    expect(pipelineRoom([{ node: "a", start_layer: 0, end_layer: 10, rank: 0 }])).toBeNull(); // no figures
  });

  it("offers ready models first for chat, then models on some disk; never ones nowhere", () => {
    const state = replay([
      [
        "snapshot",
        {
          nodes: [node("a", "a", { models: ["on-disk", "ready"] })],
          instances: [instance("i", "ready", "a")],
          models: [model("on-disk", "local"), model("nowhere", "remote"), model("ready", "loaded")],
        },
      ],
    ]);
    expect(chatModels(state).map((m) => m.id)).toEqual(["ready", "on-disk"]);
  });
});

describe("live instances", () => {
  it("counts ready and loading instances of a model, not failed or gone ones", () => {
    const state = replay([
      [
        "snapshot",
        {
          instances: [
            instance("a", "m", "n", { state: "failed" }),
            instance("b", "m", "n", { state: "gone" }),
            instance("c", "m", "n", { state: "loading" }),
            instance("d", "other", "n"),
          ],
        },
      ],
    ]);
    expect(liveInstancesOf(state, "m").map((i) => i.id)).toEqual(["c"]);
  });
});
