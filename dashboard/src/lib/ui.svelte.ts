// Page-wide UI state: which view (the URL's hash, so reloads and links keep it) and the theme.

import { loadTheme, saveTheme, type Theme } from "./prefs";

export const VIEWS = ["cluster", "models", "chat", "settings"] as const;
export type View = (typeof VIEWS)[number];

export function viewFromHash(hash: string): View {
  const name = hash.replace(/^#\/?/, "").split(/[/?]/)[0];
  return (VIEWS as readonly string[]).includes(name) ? (name as View) : "cluster";
}

export class UI {
  view: View = $state("cluster");
  theme: Theme = $state("system");
  private systemDark = $state(false);
  private readonly storage: Storage;

  constructor(storage: Storage) {
    this.storage = storage;
    this.theme = loadTheme(storage);
    this.view = viewFromHash(location.hash);
    addEventListener("hashchange", () => {
      this.view = viewFromHash(location.hash);
    });
    const dark = matchMedia("(prefers-color-scheme: dark)");
    this.systemDark = dark.matches;
    dark.addEventListener("change", () => {
      this.systemDark = dark.matches;
      this.applyTheme();
    });
    this.applyTheme();
  }

  setTheme(theme: Theme): void {
    this.theme = theme;
    saveTheme(this.storage, theme);
    this.applyTheme();
  }

  /** "light" or "dark": the choice, or the system's preference under "system". */
  get resolvedTheme(): "light" | "dark" {
    if (this.theme !== "system") return this.theme;
    return this.systemDark ? "dark" : "light";
  }

  private applyTheme(): void {
    document.documentElement.dataset.theme = this.resolvedTheme;
  }
}
