// The dashboard's picture of the cluster, and how each /v1/events event changes it (pure functions).

import type { ClusterMeta, DownloadView, InstanceView, LinkView, ModelView, NodeView, SettingsView } from "./types";

export interface DashboardState {
  cluster: ClusterMeta | null;
  nodes: Record<string, NodeView>;
  links: LinkView[];
  instances: Record<string, InstanceView>;
  settings: SettingsView | null;
  models: ModelView[];
  /** This node's downloads (a daemon without /v1/downloads sends none). */
  downloads: Record<string, DownloadView>;
}

export function emptyState(): DashboardState {
  return { cluster: null, nodes: {}, links: [], instances: {}, settings: null, models: [], downloads: {} };
}

function byId<T extends { id: string }>(items: T[] | undefined): Record<string, T> {
  const out: Record<string, T> = {};
  for (const item of items ?? []) out[item.id] = item;
  return out;
}

function without<T>(items: Record<string, T>, id: string): Record<string, T> {
  const { [id]: _removed, ...rest } = items;
  return rest;
}

interface Snapshot {
  cluster?: ClusterMeta;
  nodes?: NodeView[];
  links?: LinkView[];
  instances?: InstanceView[];
  settings?: SettingsView;
  models?: ModelView[];
  downloads?: DownloadView[];
}

/** The state after one event. Returns the same object for events it does not know (newer daemons). */
export function applyEvent(state: DashboardState, type: string, data: unknown): DashboardState {
  switch (type) {
    case "snapshot": {
      const s = data as Snapshot;
      return {
        cluster: s.cluster ?? null,
        nodes: byId(s.nodes),
        links: s.links ?? [],
        instances: byId(s.instances),
        settings: s.settings ?? null,
        models: s.models ?? [],
        downloads: byId(s.downloads),
      };
    }
    case "cluster":
      return { ...state, cluster: data as ClusterMeta };
    case "node.added":
    case "node.updated": {
      const node = data as NodeView;
      return { ...state, nodes: { ...state.nodes, [node.id]: node } };
    }
    case "node.removed":
      return { ...state, nodes: without(state.nodes, (data as { id: string }).id) };
    case "instance.added":
    case "instance.updated": {
      const instance = data as InstanceView;
      return { ...state, instances: { ...state.instances, [instance.id]: instance } };
    }
    case "instance.removed":
      return { ...state, instances: without(state.instances, (data as { id: string }).id) };
    case "download.added":
    case "download.updated": {
      const download = data as DownloadView;
      return { ...state, downloads: { ...state.downloads, [download.id]: download } };
    }
    case "download.removed":
      return { ...state, downloads: without(state.downloads, (data as { id: string }).id) };
    case "links":
      return { ...state, links: data as LinkView[] };
    case "settings":
      return { ...state, settings: data as SettingsView };
    case "models":
      return { ...state, models: data as ModelView[] };
    default:
      return state;
  }
}
