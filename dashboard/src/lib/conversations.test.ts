import { describe, expect, it } from "vitest";

import { MemoryStorage } from "../test/server";
import {
  loadChats,
  newConversation,
  removeConversation,
  saveChats,
  STORAGE_KEY,
  titleFrom,
  type ChatData,
  type Conversation,
} from "./conversations";

const conversation = (id: string, updated: number, over: Partial<Conversation> = {}): Conversation => ({
  ...newConversation("exo-demo"),
  id,
  updated,
  ...over,
});

describe("conversations in the browser", () => {
  it("round-trips, and marks a reply that was streaming at reload as stopped", () => {
    const storage = new MemoryStorage();
    const data: ChatData = {
      activeId: "b",
      conversations: [
        conversation("b", 2, {
          mtp: 2,
          messages: [
            { id: "1", role: "user", content: "hi", status: "done" },
            { id: "2", role: "assistant", content: "hel", status: "streaming" },
            { id: "3", role: "assistant", content: "x", status: "stopped", timing: { ttftMs: 80, chunks: 9, streamMs: 400 } },
          ],
        }),
        conversation("a", 1),
      ],
    };
    saveChats(storage, data);
    const loaded = loadChats(storage);
    expect(loaded.activeId).toBe("b");
    expect(loaded.conversations.map((c) => c.id)).toEqual(["b", "a"]);
    expect(loaded.conversations[0].mtp).toBe(2);
    expect(loaded.conversations[0].messages.map((m) => m.status)).toEqual(["done", "stopped", "stopped"]);
    expect(loaded.conversations[0].messages[2].timing).toEqual({ ttftMs: 80, chunks: 9, streamMs: 400 });
  });

  it("survives garbage: bad JSON, wrong shapes, unknown active id", () => {
    const storage = new MemoryStorage();
    storage.setItem(STORAGE_KEY, "{not json");
    expect(loadChats(storage)).toEqual({ conversations: [], activeId: null });
    storage.setItem(
      STORAGE_KEY,
      JSON.stringify({
        activeId: "gone",
        conversations: [
          {
            id: "ok",
            title: "t",
            messages: [
              { id: "m", role: "user", content: "x" },
              { role: "robot" },
              { id: "r", role: "assistant", content: "y", status: "stopped", timing: { ttftMs: "soon", chunks: 0 } },
            ],
            mtp: -1,
          },
          { title: "no id" },
          null,
        ],
      }),
    );
    const loaded = loadChats(storage);
    expect(loaded.conversations).toHaveLength(1);
    expect(loaded.conversations[0].messages).toHaveLength(2);
    expect(loaded.conversations[0].messages[1].timing).toBeNull(); // a malformed timing is not shown
    expect(loaded.conversations[0].mtp).toBe("auto");
    expect(loaded.activeId).toBe("ok");
  });

  it("drops the oldest conversations when the browser's quota is full", () => {
    const storage = new MemoryStorage();
    const big = "x".repeat(1000);
    const conversations = [3, 1, 2].map((n) =>
      conversation(`c${n}`, n, { messages: [{ id: "m", role: "user", content: big, status: "done" }] }),
    );
    storage.quota = 2500; // room for two
    saveChats(storage, { conversations, activeId: "c3" });
    expect(loadChats(storage).conversations.map((c) => c.id)).toEqual(["c3", "c2"]);
  });

  it("titles a conversation by its first line, and removing the active one picks another", () => {
    expect(titleFrom("  Write a function\nthat adds")).toBe("Write a function");
    expect(titleFrom("x".repeat(60))).toHaveLength(48);
    const data = { conversations: [conversation("a", 1), conversation("b", 2)], activeId: "a" };
    expect(removeConversation(data, "a")).toMatchObject({ activeId: "b" });
    expect(removeConversation(data, "b")).toMatchObject({ activeId: "a" });
  });
});
