// InstanceCard rendered for real (Svelte's server renderer: the component's own markup, no DOM needed):
// a loading instance shows its load progress, a downloading one the bytes of its weights, as a labelled
// progress bar with its value and text.
import { render } from "svelte/server";
import { describe, expect, it } from "vitest";

import type { ChatStore } from "../lib/chat.svelte";
import { appContext } from "../lib/context";
import { emptyState } from "../lib/reducer";
import type { Session } from "../lib/session.svelte";
import type { InstanceView, NodeView } from "../lib/types";
import type { UI } from "../lib/ui.svelte";
import InstanceCard from "./InstanceCard.svelte";

const GB = 1024 ** 3;

const instance = (over: Partial<InstanceView>): InstanceView =>
  ({
    id: "i1",
    model: "qwen3.5-27b-4bit",
    model_ref: "qwen3.5-27b-4bit",
    node: "n1",
    self: true,
    state: "ready",
    progress: 0,
    stage: "",
    shard: { start_layer: 0, end_layer: 64, rank: 0, world_size: 1 },
    failure: null,
    restarts: 0,
    pid: 1,
    created: 1,
    updated: 1,
    on_demand: false,
    queue_depth: 0,
    running: 0,
    native_mtp: null,
    ...over,
  }) as InstanceView;

function renderCard(view: InstanceView): string {
  const state = { ...emptyState(), nodes: { n1: { id: "n1", name: "studio" } as NodeView } };
  const session = { state, api: null } as unknown as Session;
  const context = appContext({ session, chat: null as unknown as ChatStore, ui: null as unknown as UI });
  return render(InstanceCard, { props: { instance: view }, context }).body;
}

/** The attributes of every element with role="progressbar" in ``html``. */
function progressBars(html: string): Record<string, string>[] {
  return [...html.matchAll(/<[^>]*role="progressbar"[^>]*>/g)].map((match) =>
    Object.fromEntries([...match[0].matchAll(/([\w-]+)="([^"]*)"/g)].map((a) => [a[1], a[2]])),
  );
}

function fillWidth(html: string): string | undefined {
  return html.match(/class="fill[^"]*"[^>]*style="width: ([\d.]+%)/)?.[1];
}

describe("InstanceCard", () => {
  it("shows a loading instance's progress as a labelled bar with its percentage", () => {
    const html = renderCard(instance({ state: "loading", progress: 0.42, stage: "loading weights" }));
    expect(html).toContain('data-state="loading"');
    const [bar, ...others] = progressBars(html);
    expect(others).toEqual([]);
    expect(bar["aria-label"]).toBe("loading weights");
    expect(bar["aria-valuemin"]).toBe("0");
    expect(bar["aria-valuemax"]).toBe("1");
    expect(bar["aria-valuenow"]).toBe("0.42");
    expect(bar["aria-valuetext"]).toBe("42%");
    expect(html).toMatch(/<span class="muted">42%<\/span>/); // the visible text beside the label
    expect(fillWidth(html)).toBe("42.0%");
    expect(html).toContain("studio"); // where it loads
  });

  it("shows a downloading instance's bytes, percentage and time left", () => {
    const download = {
      id: "d1",
      status: "downloading",
      bytes_done: 1 * GB,
      bytes_total: 4 * GB,
      files_done: 1,
      files_total: 4,
      speed_bytes_per_s: 100 * 1024 ** 2,
      eta_s: 31,
      elapsed_s: 10,
    };
    const html = renderCard(instance({ state: "downloading", download }));
    const [bar, ...others] = progressBars(html);
    expect(others).toEqual([]);
    expect(bar["aria-label"]).toBe("downloading the weights");
    expect(bar["aria-valuenow"]).toBe(String(GB));
    expect(bar["aria-valuemax"]).toBe(String(4 * GB));
    expect(bar["aria-valuetext"]).toBe("25% · 1.00 GB of 4.00 GB · 31 s left");
    expect(html).toContain("25% · 1.00 GB of 4.00 GB · 31 s left");
    expect(fillWidth(html)).toBe("25.0%");
  });

  it("shows no progress bar once the instance is ready", () => {
    const html = renderCard(instance({ state: "ready", progress: 1 }));
    expect(progressBars(html)).toEqual([]);
    expect(html).toContain(">ready<");
  });
});
