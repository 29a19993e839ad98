"""Save and restore cache positions/states around a timed call (benchmarks of single calls)."""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import KVCache

from exo.engine.models.layers import RollbackArraysCache


class Snapshot:
    """Saves cache positions/states so a timed call can be undone."""

    def __init__(self, caches: list[Any]):
        self.caches = caches
        self.saved = [
            c.offset if isinstance(c, KVCache) else (c[0], c[1]) for c in caches
        ]

    def restore(self) -> None:
        for cache, saved in zip(self.caches, self.saved, strict=True):
            if isinstance(cache, KVCache):
                cache.trim(cache.offset - saved)
            else:
                cache[0], cache[1] = saved
                if isinstance(cache, RollbackArraysCache):
                    cache.recording = False
                    cache.discard()
