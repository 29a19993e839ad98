import { afterEach, describe, expect, it } from "vitest";

import { event, sse, TestServer, waitFor } from "../test/server";
import { EventStreamClient, type StreamStatus } from "./sse";

let server: TestServer;
let client: EventStreamClient | null = null;

afterEach(async () => {
  await client?.stop();
  client = null;
  await server?.close();
});

function record(options: Partial<ConstructorParameters<typeof EventStreamClient>[0]> = {}) {
  const events: [string, unknown][] = [];
  const statuses: StreamStatus[] = [];
  client = new EventStreamClient({
    url: `${server.url}/v1/events`,
    onEvent: (type, data) => events.push([type, data]),
    onStatus: (status) => statuses.push(status),
    ...options,
  });
  client.start();
  return { events, statuses };
}

describe("EventStreamClient", () => {
  it("parses events, also when the network splits them, and goes live on the snapshot", async () => {
    server = await new TestServer((_req, res) => {
      sse(res);
      const whole = event("snapshot", { nodes: [] }, 1) + event("node.added", { id: "a", name: "ä node" }, 2);
      res.write(whole.slice(0, 17));
      setTimeout(() => res.write(whole.slice(17, 60)), 20);
      setTimeout(() => res.write(whole.slice(60)), 40);
    }).listen();
    const { events, statuses } = record();
    await waitFor(() => events.length === 2, "two events");
    expect(events).toEqual([
      ["snapshot", { nodes: [] }],
      ["node.added", { id: "a", name: "ä node" }],
    ]);
    expect(statuses).toEqual(["connecting", "live"]);
    expect(server.requests[0].headers.accept).toBe("text/event-stream");
  });

  it("reconnects by itself after the daemon restarts, after the server's retry delay", async () => {
    let snapshots = 0;
    server = await new TestServer((_req, res) => {
      sse(res);
      snapshots += 1;
      res.write(`retry: 50\n\n${event("snapshot", { n: snapshots })}`);
    }).listen();
    const { events, statuses } = record({ retryMs: 5000 });
    await waitFor(() => events.length === 1, "the first snapshot");
    const port = server.port;
    await server.close(); // the daemon goes away ...
    await waitFor(() => statuses.at(-1) === "reconnecting", "reconnecting");
    await new Promise((resolve) => setTimeout(resolve, 120));
    await server.listen(port); // ... and comes back on its port
    // With the default 5 s it would still be waiting: the server's `retry: 50` is what it uses.
    await waitFor(() => events.length === 2, "a fresh snapshot", 2000);
    expect(events[1]).toEqual(["snapshot", { n: 2 }]);
    expect(statuses.at(-1)).toBe("live");
  });

  it("treats a silent stream as dead, and heartbeats as signs of life", async () => {
    let beat = true;
    server = await new TestServer((_req, res) => {
      sse(res);
      res.write(event("snapshot", {}));
      const timer = setInterval(() => beat && res.write(": heartbeat\n\n"), 40);
      res.on("close", () => clearInterval(timer));
    }).listen();
    // Heartbeats every 40 ms against a 1 s idle timeout: a loaded machine's late timers (hundreds of ms under a
    // busy CI) must not read as silence.
    const { events } = record({ idleTimeoutMs: 1000, retryMs: 10 });
    await new Promise((resolve) => setTimeout(resolve, 1500));
    expect(client!.connections).toBe(1); // heartbeats kept it open
    beat = false;
    await waitFor(() => client!.connections >= 2 && events.length >= 2, "a reconnect after the silence", 5000);
    expect(server.clientClosed).toBeGreaterThanOrEqual(1);
  });

  it("backs off while attempts fail, up to the cap", async () => {
    const times: number[] = [];
    server = await new TestServer((_req, res) => {
      times.push(Date.now());
      res.writeHead(503).end("starting");
    }).listen();
    record({ retryMs: 25, maxRetryMs: 100 });
    await waitFor(() => times.length >= 5, "five attempts", 3000);
    const gaps = times.slice(1).map((t, i) => t - times[i]);
    expect(gaps[0]).toBeGreaterThanOrEqual(20);
    expect(gaps[1]).toBeGreaterThanOrEqual(45); // doubled
    expect(gaps[2]).toBeGreaterThanOrEqual(90); // doubled again, at the cap
    expect(gaps[3]).toBeLessThan(200); // and no further
  });

  it("stops on 401 until restarted, then sends the key", async () => {
    server = await new TestServer((req, res) => {
      if (req.headers.authorization !== "Bearer s3cret") {
        res.writeHead(401, { "Content-Type": "application/json" }).end('{"error":{"message":"missing key"}}');
        return;
      }
      sse(res);
      res.write(event("snapshot", { ok: true }));
    }).listen();
    let key = "";
    const { events, statuses } = record({ retryMs: 10, headers: (): Record<string, string> => (key ? { Authorization: `Bearer ${key}` } : {}) });
    await waitFor(() => statuses.includes("unauthorized"), "unauthorized");
    await new Promise((resolve) => setTimeout(resolve, 150));
    expect(server.requests).toHaveLength(1); // no retry loop against a 401
    key = "s3cret";
    await client!.restart();
    await waitFor(() => events.length === 1, "the snapshot");
    expect(statuses.at(-1)).toBe("live");
  });

  it("calls nothing after stop() and hangs up", async () => {
    server = await new TestServer((_req, res) => {
      sse(res);
      res.write(event("snapshot", {}));
      const timer = setInterval(() => res.write(event("links", [])), 10);
      res.on("close", () => clearInterval(timer));
    }).listen();
    const { events } = record();
    await waitFor(() => events.length > 2, "some events");
    await client!.stop();
    const seen = events.length;
    await new Promise((resolve) => setTimeout(resolve, 80));
    expect(events.length).toBe(seen);
    await waitFor(() => server.clientClosed === 1, "the server to see the hang-up");
    expect(client!.status).toBe("stopped");
  });
});
