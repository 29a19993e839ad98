// The page's singletons, handed to components through Svelte's context.

import { getContext, setContext } from "svelte";

import type { ChatStore } from "./chat.svelte";
import type { Session } from "./session.svelte";
import type { UI } from "./ui.svelte";

export interface AppContext {
  session: Session;
  chat: ChatStore;
  ui: UI;
}

const KEY = Symbol("exo-dashboard");

export function provideApp(context: AppContext): void {
  setContext(KEY, context);
}

export function useApp(): AppContext {
  return getContext<AppContext>(KEY);
}

/** The context a component rendered on its own (svelte/server's `render`, in unit tests) gets. */
export function appContext(context: AppContext): Map<symbol, AppContext> {
  return new Map([[KEY, context]]);
}
