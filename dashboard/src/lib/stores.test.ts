// The Svelte stores (runes classes) against a real local HTTP server: the chat store streams, stops and
// keeps conversations across a reload; the session asks for an API key and then goes live with it.
import { afterEach, describe, expect, it } from "vitest";

import { event, MemoryStorage, sse, TestServer, waitFor } from "../test/server";
import { Api } from "./api";
import { ChatStore } from "./chat.svelte";
import { Session } from "./session.svelte";

let server: TestServer;
let session: Session | null = null;
afterEach(async () => {
  await session?.stop();
  session = null;
  await server?.close();
});

const STATS = { enabled: true, reason: null, k: 2, k_fixed: true, drafted_tokens: 4, accepted_tokens: 3, acceptance_rate: 0.75 };

function chatServer(options: { endless?: boolean } = {}) {
  return new TestServer((_req, res) => {
    sse(res);
    const piece = (text: string) => `data: ${JSON.stringify({ choices: [{ delta: { content: text }, finish_reason: null }] })}\n\n`;
    if (options.endless) {
      const timer = setInterval(() => res.write(piece("tok ")), 10);
      res.on("close", () => clearInterval(timer));
      return;
    }
    res.write(piece("Hello"));
    res.write(piece(", world"));
    res.end(`data: ${JSON.stringify({ choices: [{ delta: {}, finish_reason: "stop" }], native_mtp: STATS })}\n\ndata: [DONE]\n\n`);
  }).listen();
}

describe("ChatStore", () => {
  it("streams a reply with its stats and keeps the conversation across a reload", async () => {
    server = await chatServer();
    const storage = new MemoryStorage();
    const api = new Api({ base: server.url, key: () => null });
    const chat = new ChatStore(api, storage);
    chat.newChat("exo-demo", 2);
    await chat.send("Say hello");
    const messages = chat.active!.messages;
    expect(messages.map((m) => [m.role, m.content, m.status])).toEqual([
      ["user", "Say hello", "done"],
      ["assistant", "Hello, world", "done"],
    ]);
    expect(messages[1].stats).toMatchObject({ acceptance_rate: 0.75, k: 2 });
    expect(chat.active!.title).toBe("Say hello");
    expect(JSON.parse(server.requests[0].body)).toMatchObject({ model: "exo-demo", native_mtp: { k: 2 } });

    await chat.send("Again");
    const history = JSON.parse(server.requests[1].body).messages;
    expect(history).toEqual([
      { role: "user", content: "Say hello" },
      { role: "assistant", content: "Hello, world" },
      { role: "user", content: "Again" },
    ]);

    const reloaded = new ChatStore(api, storage); // a page reload
    expect(reloaded.active?.messages.map((m) => m.content)).toEqual(["Say hello", "Hello, world", "Again", "Hello, world"]);
    expect(reloaded.active?.messages[1].stats?.acceptance_rate).toBe(0.75);
  });

  it("stop() ends the reply where it was and hangs up on the server", async () => {
    server = await chatServer({ endless: true });
    const storage = new MemoryStorage();
    const chat = new ChatStore(new Api({ base: server.url, key: () => null }), storage);
    chat.newChat("exo-demo");
    const sending = chat.send("Count forever");
    await waitFor(() => (chat.active!.messages[1]?.content.length ?? 0) > 8, "some text");
    expect(chat.busy).toBe(true);
    chat.stop();
    await sending;
    const reply = chat.active!.messages[1];
    expect(reply.status).toBe("stopped");
    expect(reply.content).toMatch(/^(tok )+/);
    // No stats from the server (it never finished): what this side measured of the stream instead.
    expect(reply.stats).toBeUndefined();
    expect(reply.timing!.chunks).toBe(reply.content.length / 4);
    expect(reply.timing!.ttftMs).toBeGreaterThanOrEqual(0);
    expect(reply.timing!.streamMs).toBeGreaterThan(0);
    expect(chat.busy).toBe(false);
    await waitFor(() => server.clientClosed === 1, "the server to see the hang-up");
    const reloaded = new ChatStore(new Api({ key: () => null }), storage).active!.messages[1];
    expect(reloaded).toMatchObject({ status: "stopped", timing: reply.timing });
  });

  it("shows a failure on the reply instead of throwing", async () => {
    server = await new TestServer((_req, res) => {
      res.writeHead(503, { "Content-Type": "application/json" }).end('{"error":{"message":"exo-demo is still loading"}}');
    }).listen();
    const chat = new ChatStore(new Api({ base: server.url, key: () => null }), new MemoryStorage());
    chat.newChat("exo-demo");
    await chat.send("hi");
    expect(chat.active!.messages[1]).toMatchObject({ status: "error", error: "exo-demo is still loading" });
  });
});

describe("Session", () => {
  it("asks for the API key on 401, then connects with it and applies the events", async () => {
    server = await new TestServer((req, res) => {
      if (req.url === "/health") {
        res.writeHead(200, { "Content-Type": "application/json" }).end('{"status":"ok","api_key_required":false}');
        return;
      }
      if (req.headers.authorization !== "Bearer right") {
        res.writeHead(401, { "Content-Type": "application/json" }).end('{"error":{"message":"missing or invalid API key"}}');
        return;
      }
      sse(res);
      res.write(event("snapshot", { nodes: [{ id: "a", name: "mac-a", self: true, models: [] }] }));
      setTimeout(() => res.write(event("node.added", { id: "b", name: "mac-b", self: false, models: [] })), 30);
    }).listen();
    const storage = new MemoryStorage();
    session = new Session({ storage: storage as unknown as Storage, base: server.url, retryMs: 10 });
    await session.start();
    await waitFor(() => session!.keyNeeded, "the key prompt");
    expect(session.status).toBe("unauthorized");
    await session.setApiKey("right");
    await waitFor(() => Object.keys(session!.state.nodes).length === 2, "both nodes");
    expect(session.status).toBe("live");
    expect(session.keyNeeded).toBe(false);
    expect(storage.getItem("exo.dashboard.apiKey")).toBe("right"); // remembered for the next visit
    expect(server.requests.at(-1)!.headers.authorization).toBe("Bearer right");
  });

  it("asks for the key before any call when /health says one is required", async () => {
    server = await new TestServer((req, res) => {
      if (req.url === "/health") {
        res.writeHead(200, { "Content-Type": "application/json" }).end('{"status":"ok","api_key_required":true}');
        return;
      }
      sse(res);
      res.write(event("snapshot", { nodes: [] }));
    }).listen();
    session = new Session({ storage: new MemoryStorage() as unknown as Storage, base: server.url });
    await session.start();
    expect(session.keyNeeded).toBe(true);
    expect(server.requests.map((r) => r.url)).toEqual(["/health"]); // no call that would be refused
    await session.setApiKey("k");
    await waitFor(() => session!.status === "live", "live");
  });

  it("an API call refused with 401 raises the key prompt too", async () => {
    server = await new TestServer((_req, res) => {
      res.writeHead(401, { "Content-Type": "application/json" }).end('{"error":{"message":"missing or invalid API key"}}');
    }).listen();
    session = new Session({ storage: new MemoryStorage() as unknown as Storage, base: server.url });
    await expect(session.api.json("PUT", "/v1/settings", { native_mtp_enabled: false })).rejects.toMatchObject({ status: 401 });
    expect(session.keyNeeded).toBe(true);
  });
});
