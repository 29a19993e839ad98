// One streamed chat completion (POST /v1/chat/completions, stream: true): text as it arrives, then the
// finish reason and the engine's native-MTP stats from the last chunk.

import { createParser, type EventSourceMessage } from "eventsource-parser";

import { ApiError, type Api } from "./api";
import type { MTPStats, StreamTiming } from "./types";

/** "auto": adaptive depth; "off": plain decoding; a number: that depth. */
export type MTPChoice = "auto" | "off" | number;

export interface ChatTurn {
  role: "system" | "user" | "assistant";
  content: string;
}

export interface ChatRequest {
  model: string;
  messages: ChatTurn[];
  mtp: MTPChoice;
  maxTokens?: number;
  temperature?: number;
}

export interface ChatResult {
  finishReason: string | null;
  stats: MTPStats | null;
}

export function requestBody(request: ChatRequest): Record<string, unknown> {
  const body: Record<string, unknown> = {
    model: request.model,
    messages: request.messages,
    stream: true,
    stream_options: { include_usage: true },
  };
  if (request.maxTokens !== undefined) body.max_tokens = request.maxTokens;
  if (request.temperature !== undefined) body.temperature = request.temperature;
  if (request.mtp === "off") body.native_mtp = { enabled: false };
  else if (typeof request.mtp === "number") body.native_mtp = { k: request.mtp };
  return body;
}

interface StreamChunk {
  error?: { message?: string; code?: string };
  choices?: { delta?: { content?: string | null }; finish_reason?: string | null }[];
  native_mtp?: MTPStats | null;
  usage?: { native_mtp?: MTPStats } | null;
}

/** Streams the reply into ``onText``; resolves when the server ends the stream. Abort ``signal`` to stop
 * the generation (the daemon cancels it when the connection closes); the promise then rejects with the
 * AbortError. */
export async function streamChat(
  api: Api,
  request: ChatRequest,
  onText: (text: string) => void,
  signal?: AbortSignal,
): Promise<ChatResult> {
  const response = await api.send("POST", "/v1/chat/completions", requestBody(request), signal);
  if (!response.body) throw new ApiError(502, "the server sent no stream");
  const result: ChatResult = { finishReason: null, stats: null };
  let failure: ApiError | null = null;
  let done = false;
  const parser = createParser({
    onEvent: (message: EventSourceMessage) => {
      if (message.data === "[DONE]") {
        done = true;
        return;
      }
      const chunk = JSON.parse(message.data) as StreamChunk;
      if (chunk.error) {
        failure = new ApiError(500, chunk.error.message ?? "the generation failed", chunk.error.code ?? null);
        return;
      }
      const choice = chunk.choices?.[0];
      if (choice?.delta?.content) onText(choice.delta.content);
      if (choice?.finish_reason) {
        result.finishReason = choice.finish_reason;
        if (chunk.native_mtp) result.stats = chunk.native_mtp;
      }
      if (chunk.usage?.native_mtp) result.stats = chunk.usage.native_mtp;
    },
  });
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  try {
    for (;;) {
      const { done: ended, value } = await reader.read();
      if (ended) break;
      parser.feed(decoder.decode(value, { stream: true }));
    }
  } finally {
    reader.releaseLock();
  }
  if (failure) throw failure;
  if (!done && result.finishReason === null) throw new ApiError(502, "the stream ended before the reply did");
  return result;
}

/** Times a streamed reply as it arrives: call ``piece()`` for each piece of text. */
export class StreamClock {
  private readonly started: number;
  private readonly now: () => number;
  private firstAt: number | null = null;
  private lastAt = 0;
  private chunks = 0;

  constructor(now: () => number = () => performance.now()) {
    this.now = now;
    this.started = now();
  }

  piece(): void {
    const at = this.now();
    this.firstAt ??= at;
    this.lastAt = at;
    this.chunks += 1;
  }

  /** Null until the first piece came. */
  timing(): StreamTiming | null {
    if (this.firstAt === null) return null;
    return { ttftMs: Math.round(this.firstAt - this.started), chunks: this.chunks, streamMs: Math.round(this.lastAt - this.firstAt) };
  }
}
