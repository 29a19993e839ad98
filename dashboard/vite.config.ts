import { svelte } from "@sveltejs/vite-plugin-svelte";
import { defineConfig } from "vitest/config";

// The bundle is committed inside the Python package (src/exo/assets/dashboard/), so a Python-only user
// never needs Node; tests/dashboard/test_bundle.py rebuilds it and fails if the committed copy differs.
// Everything here aims at byte-identical output: content hashes in names, no timestamps, no source maps.
export default defineConfig({
  plugins: [svelte()],
  base: "./",
  build: {
    outDir: "../src/exo/assets/dashboard",
    emptyOutDir: true,
    sourcemap: false,
    reportCompressedSize: false,
    assetsInlineLimit: 0,
    target: "es2022",
  },
  server: {
    // `npm run dev` talks to a local `exo serve` (default port) for /v1/*.
    proxy: { "/v1": { target: process.env.EXO_URL ?? "http://127.0.0.1:52415", changeOrigin: true } },
  },
  test: {
    include: ["src/**/*.test.ts"],
    environment: "node",
  },
});
