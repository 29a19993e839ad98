// The chat: conversations (kept in the browser), the reply being streamed, and stopping it.

import type { Api } from "./api";
import { StreamClock, streamChat, type ChatTurn, type MTPChoice } from "./chat";
import {
  loadChats,
  newConversation,
  newId,
  removeConversation,
  saveChats,
  titleFrom,
  updateConversation,
  updateMessage,
  type ChatData,
  type ChatMessage,
  type Conversation,
  type KeyValueStorage,
} from "./conversations";

const SAVE_EVERY_MS = 1000; // while a reply streams; always at its end

export class ChatStore {
  data: ChatData = $state.raw({ conversations: [], activeId: null });
  /** Conversation ids with a reply streaming. */
  streaming: string[] = $state([]);
  private readonly controllers = new Map<string, AbortController>();
  private readonly storage: KeyValueStorage;
  private readonly api: Api;
  private savedAt = 0;

  constructor(api: Api, storage: KeyValueStorage) {
    this.api = api;
    this.storage = storage;
    this.data = loadChats(storage);
  }

  get active(): Conversation | null {
    return this.data.conversations.find((c) => c.id === this.data.activeId) ?? null;
  }

  get busy(): boolean {
    return this.data.activeId !== null && this.streaming.includes(this.data.activeId);
  }

  private commit(data: ChatData, save: "now" | "throttled" = "now"): void {
    this.data = data;
    const now = Date.now();
    if (save === "now" || now - this.savedAt >= SAVE_EVERY_MS) {
      this.savedAt = now;
      saveChats(this.storage, data);
    }
  }

  newChat(model: string | null, mtp: MTPChoice = "auto"): Conversation {
    const conversation = newConversation(model, mtp);
    this.commit({ conversations: [conversation, ...this.data.conversations], activeId: conversation.id });
    return conversation;
  }

  select(id: string): void {
    this.commit({ ...this.data, activeId: id });
  }

  remove(id: string): void {
    this.controllers.get(id)?.abort();
    this.commit(removeConversation(this.data, id));
  }

  configure(change: Partial<Pick<Conversation, "model" | "mtp" | "temperature" | "maxTokens">>): void {
    const active = this.active;
    if (active) this.commit(updateConversation(this.data, active.id, (c) => ({ ...c, ...change })));
  }

  /** Sends ``text`` in the active conversation (a new one if none) and streams the reply into it. */
  async send(text: string): Promise<void> {
    const conversation = this.active;
    // The view sends only with a model chosen and nothing streaming; anything else is a no-op.
    if (!conversation?.model || !text.trim() || this.streaming.includes(conversation.id)) return;
    const id = conversation.id;
    const model = conversation.model;
    const history: ChatTurn[] = conversation.messages
      .filter((m) => m.status === "done" || (m.status === "stopped" && m.content))
      .map((m) => ({ role: m.role, content: m.content }));
    history.push({ role: "user", content: text });
    const user: ChatMessage = { id: newId(), role: "user", content: text, status: "done" };
    const reply: ChatMessage = { id: newId(), role: "assistant", content: "", status: "streaming", model };
    this.commit(
      updateConversation(this.data, id, (c) => ({
        ...c,
        title: c.messages.length === 0 ? titleFrom(text) : c.title,
        messages: [...c.messages, user, reply],
      })),
    );
    const controller = new AbortController();
    this.controllers.set(id, controller);
    this.streaming = [...this.streaming, id];
    const started = performance.now();
    const clock = new StreamClock();
    let content = "";
    const finish = (change: Partial<ChatMessage>) => {
      const elapsedMs = Math.round(performance.now() - started);
      const timing = clock.timing();
      this.commit(updateConversation(this.data, id, (c) => updateMessage(c, reply.id, { content, elapsedMs, timing, ...change })));
    };
    try {
      const result = await streamChat(
        this.api,
        {
          model,
          messages: history,
          mtp: conversation.mtp,
          temperature: conversation.temperature ?? undefined,
          maxTokens: conversation.maxTokens ?? undefined,
        },
        (piece) => {
          clock.piece();
          content += piece;
          this.commit(updateConversation(this.data, id, (c) => updateMessage(c, reply.id, { content })), "throttled");
        },
        controller.signal,
      );
      finish({ status: "done", stats: result.stats, finishReason: result.finishReason });
    } catch (error) {
      if (controller.signal.aborted) finish({ status: "stopped" });
      else finish({ status: "error", error: error instanceof Error ? error.message : String(error) });
    } finally {
      this.controllers.delete(id);
      this.streaming = this.streaming.filter((s) => s !== id);
    }
  }

  /** Stops the active conversation's reply (the daemon cancels the generation when we hang up). */
  stop(): void {
    if (this.data.activeId) this.controllers.get(this.data.activeId)?.abort();
  }
}
