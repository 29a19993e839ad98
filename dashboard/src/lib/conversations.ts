// Conversations kept in the browser (localStorage) across reloads: plain data and pure updates; the
// Svelte store (chat.svelte.ts) holds the current value and saves it.

import type { MTPChoice } from "./chat";
import type { MTPStats, StreamTiming } from "./types";

export const STORAGE_KEY = "exo.dashboard.conversations";
const MAX_CONVERSATIONS = 50;

export type MessageStatus = "streaming" | "done" | "stopped" | "error";

export interface ChatMessage {
  id: string;
  role: "user" | "assistant";
  content: string;
  status: MessageStatus;
  model?: string;
  error?: string;
  finishReason?: string | null;
  stats?: MTPStats | null;
  /** Wall time from send to the end of the reply, measured here. */
  elapsedMs?: number;
  /** Time to the first token and pieces per second, measured here (what a stopped reply shows). */
  timing?: StreamTiming | null;
}

export interface Conversation {
  id: string;
  title: string;
  model: string | null;
  mtp: MTPChoice;
  /** Sampling for this conversation's replies; null: the server's default. */
  temperature: number | null;
  maxTokens: number | null;
  messages: ChatMessage[];
  updated: number;
}

export interface ChatData {
  conversations: Conversation[];
  activeId: string | null;
}

/** The parts of localStorage this uses (tests pass a Map-backed one). */
export interface KeyValueStorage {
  getItem(key: string): string | null;
  setItem(key: string, value: string): void;
}

export function newId(): string {
  return Math.random().toString(36).slice(2, 10) + Date.now().toString(36);
}

export function newConversation(model: string | null, mtp: MTPChoice = "auto"): Conversation {
  return { id: newId(), title: "New chat", model, mtp, temperature: null, maxTokens: null, messages: [], updated: Date.now() };
}

/** The first line of the first message, shortened. */
export function titleFrom(text: string): string {
  const line = text.trim().split("\n")[0].trim();
  return line.length > 48 ? `${line.slice(0, 47)}…` : line || "New chat";
}

function finiteOrNull(value: unknown): number | null {
  return typeof value === "number" && Number.isFinite(value) && value >= 0 ? value : null;
}

function isMessage(value: unknown): value is ChatMessage {
  const m = value as ChatMessage;
  return !!m && typeof m.id === "string" && (m.role === "user" || m.role === "assistant") && typeof m.content === "string";
}

function isTiming(value: unknown): value is StreamTiming {
  const t = value as StreamTiming;
  return !!t && [t.ttftMs, t.chunks, t.streamMs].every((n) => finiteOrNull(n) !== null) && t.chunks >= 1;
}

function isConversation(value: unknown): value is Conversation {
  const c = value as Conversation;
  return !!c && typeof c.id === "string" && typeof c.title === "string" && Array.isArray(c.messages);
}

/** What was saved, cleaned: anything malformed is dropped, and a reply that was streaming when the page
 * went away is marked stopped (its generation ended with the page). */
export function loadChats(storage: KeyValueStorage): ChatData {
  let raw: unknown;
  try {
    raw = JSON.parse(storage.getItem(STORAGE_KEY) ?? "null");
  } catch {
    raw = null;
  }
  const data = raw as Partial<ChatData> | null;
  const conversations = (Array.isArray(data?.conversations) ? data.conversations : [])
    .filter(isConversation)
    .map((c): Conversation => ({
      ...c,
      model: typeof c.model === "string" ? c.model : null,
      mtp: c.mtp === "off" || (typeof c.mtp === "number" && c.mtp >= 1) ? c.mtp : "auto",
      temperature: finiteOrNull(c.temperature),
      maxTokens: finiteOrNull(c.maxTokens),
      messages: c.messages
        .filter(isMessage)
        .map((m) => ({ ...m, status: m.status === "streaming" ? "stopped" : m.status, timing: isTiming(m.timing) ? m.timing : null })),
    }));
  const activeId = conversations.some((c) => c.id === data?.activeId) ? (data?.activeId ?? null) : (conversations[0]?.id ?? null);
  return { conversations, activeId };
}

/** Saves; when the browser's quota is full, the oldest conversations go first. */
export function saveChats(storage: KeyValueStorage, data: ChatData): void {
  let conversations = [...data.conversations].sort((a, b) => b.updated - a.updated).slice(0, MAX_CONVERSATIONS);
  for (;;) {
    try {
      storage.setItem(STORAGE_KEY, JSON.stringify({ conversations, activeId: data.activeId }));
      return;
    } catch (error) {
      if (conversations.length <= 1) throw error;
      conversations = conversations.slice(0, -1);
    }
  }
}

export function updateConversation(data: ChatData, id: string, change: (c: Conversation) => Conversation): ChatData {
  return {
    ...data,
    conversations: data.conversations.map((c) => (c.id === id ? { ...change(c), updated: Date.now() } : c)),
  };
}

export function updateMessage(c: Conversation, messageId: string, change: Partial<ChatMessage>): Conversation {
  return { ...c, messages: c.messages.map((m) => (m.id === messageId ? { ...m, ...change } : m)) };
}

export function removeConversation(data: ChatData, id: string): ChatData {
  const conversations = data.conversations.filter((c) => c.id !== id);
  const activeId = data.activeId === id ? (conversations[0]?.id ?? null) : data.activeId;
  return { conversations, activeId };
}
