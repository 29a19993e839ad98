// Questions the views ask of the state: which nodes, in what order; what runs where; what is on disk.

import type { DashboardState } from "./reducer";
import type { InstanceView, ModelView, NodeView, PlacementView, StageView } from "./types";

/** This node first, then the others by name. */
export function sortedNodes(state: DashboardState): NodeView[] {
  return Object.values(state.nodes).sort(
    (a, b) => Number(b.self) - Number(a.self) || a.name.localeCompare(b.name) || a.id.localeCompare(b.id),
  );
}

export function nodeName(state: DashboardState, id: string): string {
  return state.nodes[id]?.name ?? id.slice(0, 8);
}

/** An instance's stages: the pipeline's when it has one, else the one stage of its shard. */
export function stagesOf(instance: InstanceView): StageView[] {
  if (instance.stages && instance.stages.length > 0) return instance.stages;
  const { start_layer, end_layer, rank } = instance.shard;
  return [{ node: instance.node, start_layer, end_layer, rank, state: instance.state }];
}

export function placementStages(placement: PlacementView): StageView[] {
  if (placement.stages && placement.stages.length > 0) return placement.stages;
  if (placement.shards.length === 0) return [{ node: placement.node, start_layer: 0, end_layer: 0, rank: 0 }];
  return placement.shards.map((s) => ({ node: s.node_id, start_layer: s.start_layer, end_layer: s.end_layer, rank: s.rank }));
}

/** A pipeline's stages together: what they need in all, and the stage whose node has the least room left
 * after its share (null without a placement preview's per-stage figures). */
export function pipelineRoom(stages: StageView[]): { neededBytes: number; tightest: StageView; leftBytes: number } | null {
  if (stages.length === 0 || stages.some((s) => s.needed_bytes == null || s.free_bytes == null)) return null;
  const left = (s: StageView) => s.free_bytes! - s.needed_bytes!;
  const tightest = stages.reduce((a, b) => (left(b) < left(a) ? b : a));
  return { neededBytes: stages.reduce((sum, s) => sum + s.needed_bytes!, 0), tightest, leftBytes: left(tightest) };
}

/** Newest first; gone instances last. */
export function sortedInstances(state: DashboardState): InstanceView[] {
  return Object.values(state.instances).sort(
    (a, b) => Number(a.state === "gone") - Number(b.state === "gone") || b.created - a.created,
  );
}

/** The instances with a stage on ``nodeId``. */
export function instancesOn(state: DashboardState, nodeId: string): InstanceView[] {
  return sortedInstances(state).filter((i) => stagesOf(i).some((s) => s.node === nodeId));
}

/** The nodes that hold the model's weights. */
export function nodesWithModel(state: DashboardState, modelId: string): NodeView[] {
  return sortedNodes(state).filter((n) => n.models.includes(modelId));
}

/** The model's instances that run or are on their way (not failed, stopping or gone). */
export function liveInstancesOf(state: DashboardState, modelId: string): InstanceView[] {
  return sortedInstances(state).filter((i) => i.model === modelId && (i.state === "ready" || i.state === "loading" || i.state === "downloading"));
}

export function memoryUsedBytes(node: NodeView): number {
  return Math.max(0, node.memory_total_bytes - node.memory_available_bytes);
}

/** Models a chat can use: ready ones first, then those on some node's disk (they load on demand). */
export function chatModels(state: DashboardState): ModelView[] {
  const ready = new Set(Object.values(state.instances).filter((i) => i.state === "ready").map((i) => i.model));
  const onDisk = new Set(Object.values(state.nodes).flatMap((n) => n.models));
  const usable = state.models.filter((m) => ready.has(m.id) || onDisk.has(m.id) || m.status !== "remote");
  return usable.sort((a, b) => Number(ready.has(b.id)) - Number(ready.has(a.id)));
}
