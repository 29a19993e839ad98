// A server-sent-events client over fetch (EventSource cannot send the Authorization header), that
// reconnects by itself: after the stream ends or fails it waits the server's `retry:` delay (doubling
// while attempts keep failing, up to 5 s) and connects again. A stream that stays silent longer than
// `idleTimeoutMs` (the daemon sends a heartbeat comment every 15 s) counts as dead. A 401 stops the loop
// until `restart()` (the user typed a key).

import { createParser, type EventSourceMessage } from "eventsource-parser";

export type StreamStatus = "connecting" | "live" | "reconnecting" | "unauthorized" | "stopped";

export interface EventStreamOptions {
  url: string;
  onEvent: (type: string, data: unknown) => void;
  onStatus?: (status: StreamStatus, detail: string | null) => void;
  headers?: () => Record<string, string>;
  fetch?: typeof fetch;
  /** The event that marks the stream as live (the daemon's first event). */
  liveOn?: string;
  retryMs?: number;
  maxRetryMs?: number;
  idleTimeoutMs?: number;
}

export class EventStreamClient {
  status: StreamStatus = "stopped";
  /** Connections opened so far (the first one included). */
  connections = 0;
  private readonly options: EventStreamOptions;
  private retryMs: number;
  private running = false;
  private controller: AbortController | null = null;
  private wake: (() => void) | null = null;
  private loop: Promise<void> | null = null;

  constructor(options: EventStreamOptions) {
    this.options = options;
    this.retryMs = options.retryMs ?? 1000;
  }

  start(): void {
    if (this.running) return;
    this.running = true;
    this.loop = this.run();
  }

  /** Stop and wait until the loop has ended (no callback runs after this resolves). */
  async stop(): Promise<void> {
    this.running = false;
    this.controller?.abort();
    this.wake?.();
    await this.loop;
    this.setStatus("stopped", null);
  }

  /** Connect again now (a new API key, or the user asked). */
  async restart(): Promise<void> {
    await this.stop();
    this.start();
  }

  private setStatus(status: StreamStatus, detail: string | null): void {
    this.status = status;
    this.options.onStatus?.(status, detail);
  }

  private async run(): Promise<void> {
    let failures = 0;
    while (this.running) {
      this.setStatus(this.connections === 0 ? "connecting" : "reconnecting", null);
      let live = false;
      let detail: string | null = null;
      try {
        live = await this.connect();
      } catch (error) {
        detail = error instanceof Error ? error.message : String(error);
      }
      if (!this.running || this.status === "unauthorized") return;
      failures = live ? 0 : failures + 1;
      this.setStatus("reconnecting", detail);
      const delay = Math.min(this.retryMs * 2 ** Math.max(0, failures - 1), this.options.maxRetryMs ?? 5000);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(resolve, delay);
        this.wake = () => {
          clearTimeout(timer);
          resolve();
        };
      });
      this.wake = null;
    }
  }

  /** One connection, until it ends. True when it got as far as the live event. */
  private async connect(): Promise<boolean> {
    const controller = (this.controller = new AbortController());
    const fetchImpl = this.options.fetch ?? fetch;
    this.connections += 1;
    const response = await fetchImpl(this.options.url, {
      headers: { Accept: "text/event-stream", ...(this.options.headers?.() ?? {}) },
      signal: controller.signal,
      cache: "no-store",
    });
    if (response.status === 401) {
      const text = await response.text().catch(() => "");
      this.setStatus("unauthorized", text);
      return false;
    }
    if (!response.ok || !response.body) {
      await response.body?.cancel().catch(() => undefined);
      throw new Error(`the event stream answered ${response.status}`);
    }
    let live = false;
    const liveOn = this.options.liveOn ?? "snapshot";
    const parser = createParser({
      onEvent: (message: EventSourceMessage) => {
        const type = message.event ?? "message";
        let data: unknown;
        try {
          data = JSON.parse(message.data);
        } catch {
          return; // not JSON: not an event of ours
        }
        if (type === liveOn && !live) {
          live = true;
          this.setStatus("live", null);
        }
        this.options.onEvent(type, data);
      },
      onRetry: (ms: number) => {
        this.retryMs = ms;
      },
    });
    const idleMs = this.options.idleTimeoutMs ?? 40_000;
    let idle = setTimeout(() => controller.abort(), idleMs);
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    try {
      for (;;) {
        const { done, value } = await reader.read();
        if (done) break;
        clearTimeout(idle);
        idle = setTimeout(() => controller.abort(), idleMs);
        parser.feed(decoder.decode(value, { stream: true }));
      }
    } catch (error) {
      if (!live) throw error; // a live stream that breaks (daemon gone, idle) just ends: reconnect
    } finally {
      clearTimeout(idle);
      await reader.cancel().catch(() => undefined);
    }
    return live;
  }
}
