// The page's connection to its daemon: the API key, the API client, and the live state that
// /v1/events keeps current. One Session per page (main.ts); tests make their own.

import { Api } from "./api";
import { loadApiKey, saveApiKey } from "./prefs";
import { applyEvent, emptyState, type DashboardState } from "./reducer";
import { EventStreamClient, type StreamStatus } from "./sse";

export interface SessionOptions {
  storage: Storage;
  base?: string;
  fetch?: typeof fetch;
  retryMs?: number;
  idleTimeoutMs?: number;
}

export class Session {
  state: DashboardState = $state.raw(emptyState());
  status: StreamStatus = $state("stopped");
  statusDetail: string | null = $state(null);
  apiKey: string | null = $state(null);
  /** The daemon refused us (EXO_API_KEY is set): the page asks for the key. */
  keyNeeded = $state(false);
  /** Events applied since the page loaded (what "live" means, for the curious). */
  eventsSeen = $state(0);
  readonly api: Api;
  private readonly options: SessionOptions;
  private readonly storage: Storage;
  private readonly stream: EventStreamClient;

  constructor(options: SessionOptions) {
    this.options = options;
    this.storage = options.storage;
    this.apiKey = loadApiKey(options.storage);
    const base = options.base ?? "";
    this.api = new Api({
      base,
      fetch: options.fetch,
      key: () => this.apiKey,
      onUnauthorized: () => {
        this.keyNeeded = true;
      },
    });
    this.stream = new EventStreamClient({
      url: `${base}/v1/events`,
      fetch: options.fetch,
      retryMs: options.retryMs,
      idleTimeoutMs: options.idleTimeoutMs,
      headers: () => this.api.headers(),
      onEvent: (type, data) => {
        this.state = applyEvent(this.state, type, data);
        this.eventsSeen += 1;
      },
      onStatus: (status, detail) => {
        this.status = status;
        this.statusDetail = detail;
        if (status === "unauthorized") this.keyNeeded = true;
      },
    });
  }

  /** Connects. A daemon that requires a key (its /health says so) is asked for one first, unless this
   * browser remembers one: the page makes no call it knows will be refused. */
  async start(): Promise<void> {
    if (!this.apiKey) {
      try {
        const response = await (this.options.fetch ?? fetch)(`${this.options.base ?? ""}/health`, { cache: "no-store" });
        const health = (await response.json()) as { api_key_required?: boolean };
        if (health.api_key_required) {
          this.keyNeeded = true;
          this.status = "unauthorized";
          return;
        }
      } catch {
        // the daemon is not up (yet): the stream keeps trying
      }
    }
    this.stream.start();
  }

  async stop(): Promise<void> {
    await this.stream.stop();
  }

  /** Use this key from now on (remembered in the browser); null forgets it. */
  async setApiKey(key: string | null): Promise<void> {
    this.apiKey = key?.trim() || null;
    saveApiKey(this.storage, this.apiKey);
    this.keyNeeded = false;
    await this.stream.restart();
  }
}
