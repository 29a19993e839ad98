// What the browser remembers for this dashboard besides conversations: the theme and the API key.

import type { KeyValueStorage } from "./conversations";

export type Theme = "system" | "light" | "dark";
const THEME_KEY = "exo.dashboard.theme";
const API_KEY = "exo.dashboard.apiKey";

export function loadTheme(storage: KeyValueStorage): Theme {
  const value = storage.getItem(THEME_KEY);
  return value === "light" || value === "dark" ? value : "system";
}

export function saveTheme(storage: KeyValueStorage, theme: Theme): void {
  storage.setItem(THEME_KEY, theme);
}

export function loadApiKey(storage: KeyValueStorage): string | null {
  return storage.getItem(API_KEY) || null;
}

export function saveApiKey(storage: KeyValueStorage & { removeItem(key: string): void }, key: string | null): void {
  if (key) storage.setItem(API_KEY, key);
  else storage.removeItem(API_KEY);
}
