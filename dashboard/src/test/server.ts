// A real HTTP server on 127.0.0.1 for the unit tests of the SSE and chat clients: they talk to it
// through Node's own fetch, so reconnects, aborts and partial chunks are real, not simulated.

import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

export type Handler = (req: IncomingMessage, res: ServerResponse, body: string) => void;

export class TestServer {
  handler: Handler;
  /** Every request seen: method, path, headers, body. */
  requests: { method: string; url: string; headers: IncomingMessage["headers"]; body: string }[] = [];
  /** Responses not finished yet (open streams). */
  open = new Set<ServerResponse>();
  /** Requests whose client hung up before the response ended. */
  clientClosed = 0;
  port = 0;
  private server: Server | null = null;

  constructor(handler: Handler) {
    this.handler = handler;
  }

  get url(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  async listen(port = 0): Promise<this> {
    const server = createServer((req, res) => {
      let body = "";
      req.on("data", (chunk: Buffer) => (body += chunk.toString()));
      req.on("end", () => {
        this.requests.push({ method: req.method ?? "", url: req.url ?? "", headers: req.headers, body });
        this.open.add(res);
        res.on("close", () => {
          if (!res.writableFinished) this.clientClosed += 1;
          this.open.delete(res);
        });
        this.handler(req, res, body);
      });
    });
    await new Promise<void>((resolve) => server.listen(port, "127.0.0.1", resolve));
    this.server = server;
    this.port = (server.address() as AddressInfo).port;
    return this;
  }

  /** Stop like a daemon that exits: every open connection dropped, the port closed. */
  async close(): Promise<void> {
    for (const res of this.open) res.destroy();
    this.server?.closeAllConnections();
    await new Promise<void>((resolve) => (this.server ? this.server.close(() => resolve()) : resolve()));
    this.server = null;
  }
}

export function sse(res: ServerResponse, status = 200): void {
  res.writeHead(status, { "Content-Type": "text/event-stream", "Cache-Control": "no-cache" });
  res.flushHeaders();
}

export function event(type: string, data: unknown, id?: number): string {
  return `${id === undefined ? "" : `id: ${id}\n`}event: ${type}\ndata: ${JSON.stringify(data)}\n\n`;
}

export async function waitFor<T>(check: () => T, what: string, timeoutMs = 3000): Promise<NonNullable<T>> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = check();
    if (value) return value as NonNullable<T>;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

/** A Map-backed Storage (the parts of localStorage the dashboard uses). */
export class MemoryStorage implements Pick<Storage, "getItem" | "setItem" | "removeItem"> {
  values = new Map<string, string>();
  quota = Infinity;

  getItem(key: string): string | null {
    return this.values.get(key) ?? null;
  }

  setItem(key: string, value: string): void {
    if (value.length > this.quota) throw new DOMException("quota exceeded", "QuotaExceededError");
    this.values.set(key, value);
  }

  removeItem(key: string): void {
    this.values.delete(key);
  }
}
