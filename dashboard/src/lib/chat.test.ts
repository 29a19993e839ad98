import { afterEach, describe, expect, it } from "vitest";

import { sse, TestServer, waitFor } from "../test/server";
import { Api, ApiError } from "./api";
import { requestBody, StreamClock, streamChat } from "./chat";

let server: TestServer;
afterEach(async () => server?.close());

const STATS = {
  enabled: true,
  reason: null,
  k: 2,
  k_fixed: true,
  k_histogram: { "2": 3 },
  rounds: 3,
  drafted_tokens: 6,
  accepted_tokens: 5,
  acceptance_rate: 0.8333,
  per_position_acceptance: [1, 0.667],
  ttft_ms: 42,
  decode_tokens_per_s: 88.5,
  prompt_tokens: 9,
  completion_tokens: 8,
};

/** The chunks `exo serve` sends for one streamed chat reply (see src/exo/api/completions.py). */
function daemonReply(pieces: string[]): string {
  const base = { id: "chatcmpl-1", object: "chat.completion.chunk", created: 1, model: "exo-demo", system_fingerprint: null };
  const chunk = (delta: object, finish: string | null, extra: object = {}) =>
    `data: ${JSON.stringify({ ...base, choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }], ...extra })}\n\n`;
  return [
    chunk({ role: "assistant", content: "" }, null),
    ...pieces.map((p) => chunk({ content: p }, null)),
    chunk({}, "stop", { native_mtp: STATS }),
    `data: ${JSON.stringify({ ...base, choices: [], usage: { completion_tokens: 8, native_mtp: STATS } })}\n\n`,
    "data: [DONE]\n\n",
  ].join("");
}

const api = (key: string | null = null) => new Api({ base: server.url, key: () => key });
const request = { model: "exo-demo", messages: [{ role: "user" as const, content: "hi" }], mtp: 2 as const };

describe("requestBody", () => {
  it("asks for a stream with usage, and says what native MTP should do", () => {
    expect(requestBody({ ...request, mtp: "auto" })).toEqual({
      model: "exo-demo",
      messages: request.messages,
      stream: true,
      stream_options: { include_usage: true },
    });
    expect(requestBody({ ...request, mtp: "off" }).native_mtp).toEqual({ enabled: false });
    expect(requestBody({ ...request, mtp: 3, maxTokens: 64, temperature: 0 })).toMatchObject({
      native_mtp: { k: 3 },
      max_tokens: 64,
      temperature: 0,
    });
  });
});

describe("streamChat", () => {
  it("streams the text and returns the finish reason and native-MTP stats", async () => {
    server = await new TestServer((_req, res) => {
      sse(res);
      const body = daemonReply(["def ", "add(a, b):", "\n    return a + b"]);
      res.write(body.slice(0, 100)); // chunk boundaries that cut events in half
      setTimeout(() => res.end(body.slice(100)), 20);
    }).listen();
    const pieces: string[] = [];
    const result = await streamChat(api("k1"), request, (text) => pieces.push(text));
    expect(pieces.join("")).toBe("def add(a, b):\n    return a + b");
    expect(result).toEqual({ finishReason: "stop", stats: STATS });
    const sent = server.requests[0];
    expect(sent.url).toBe("/v1/chat/completions");
    expect(sent.headers.authorization).toBe("Bearer k1");
    expect(JSON.parse(sent.body)).toMatchObject({ stream: true, native_mtp: { k: 2 } });
  });

  it("turns an error before the stream into an ApiError with the server's message", async () => {
    server = await new TestServer((_req, res) => {
      res.writeHead(404, { "Content-Type": "application/json" });
      res.end(JSON.stringify({ error: { message: "unknown model 'nope'", code: "model_not_found" } }));
    }).listen();
    const error = await streamChat(api(), { ...request, model: "nope" }, () => {}).catch((e: unknown) => e);
    expect(error).toBeInstanceOf(ApiError);
    expect(error).toMatchObject({ status: 404, message: "unknown model 'nope'", code: "model_not_found" });
  });

  it("turns an error event inside the stream into an ApiError", async () => {
    server = await new TestServer((_req, res) => {
      sse(res);
      res.end(`data: ${JSON.stringify({ error: { message: "node b stopped answering", code: "node_unavailable" } })}\n\ndata: [DONE]\n\n`);
    }).listen();
    await expect(streamChat(api(), request, () => {})).rejects.toMatchObject({ message: "node b stopped answering" });
  });

  it("fails a stream cut before the reply ended", async () => {
    server = await new TestServer((_req, res) => {
      sse(res);
      res.end(daemonReply(["partial"]).split("\n\n").slice(0, 2).join("\n\n") + "\n\n");
    }).listen();
    await expect(streamChat(api(), request, () => {})).rejects.toThrow(/ended before the reply/);
  });

  it("stops: aborting hangs up, which is how the daemon learns to cancel the generation", async () => {
    server = await new TestServer((_req, res) => {
      sse(res);
      const timer = setInterval(() => res.write(`data: ${JSON.stringify({ choices: [{ delta: { content: "x" } }] })}\n\n`), 10);
      res.on("close", () => clearInterval(timer));
    }).listen();
    const controller = new AbortController();
    let text = "";
    const done = streamChat(api(), request, (t) => (text += t), controller.signal);
    await waitFor(() => text.length >= 3, "some text");
    controller.abort();
    await expect(done).rejects.toMatchObject({ name: "AbortError" });
    await waitFor(() => server.clientClosed === 1, "the server to see the hang-up");
  });
});

describe("StreamClock", () => {
  it("times the first piece from the start, and the pieces after it", () => {
    let now = 1000;
    const clock = new StreamClock(() => now);
    now = 1250;
    expect(clock.timing()).toBeNull(); // nothing came yet
    clock.piece();
    now = 1300;
    clock.piece();
    now = 1750;
    clock.piece();
    now = 9000; // the reader stopping later changes nothing
    expect(clock.timing()).toEqual({ ttftMs: 250, chunks: 3, streamMs: 500 });
  });
});
