"""The MTP head's side of one sequence: the head's cache, the (hidden, next token) rows waiting for it, and the
rows it never saw.

Entry p of the head's cache pairs the backbone's hidden at position p with the token at p + 1, so a row can
enter the head only once its next token is known. Rows wait here until a round drafts (the head takes them in
one call, ``flush``) or a long plain stretch flushes them off the token path; where the depth policy decodes
plainly, only the last few wait (``keep_window``) and the ones before are skipped: the head's context then has
a gap there, which costs acceptance, never output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class HeadRows:
    """``module``: the MTP head (None: the sequence never drafts); ``tracked``: whether rows are kept at all
    (a head that cannot pay off on this device is never fed).

    Invariant, while tracked: cache entries + waiting rows + ``skipped`` = the backbone caches' positions
    whose next token is known (``check``)."""

    def __init__(self, module: Any, embed: Callable[[mx.array], mx.array], tracked: bool) -> None:
        self.module = module
        self.embed = embed
        self.tracked = tracked
        self.cache = KVCache()
        self._hidden: list[mx.array] = []  # [1, T, H] each
        self._tokens: list[mx.array] = []  # [T] each: the token after each row
        self.skipped = 0  # rows dropped before the head saw them (its context has a gap there)

    @property
    def waiting(self) -> int:
        return sum(h.shape[1] for h in self._hidden)

    @property
    def last_row(self) -> mx.array:
        """The hidden [1, 1, H] of the last waiting row (what a prefix cache stores as ``head_row``)."""
        return self._hidden[-1][:, -1:]

    def wait(self, hidden: mx.array | None, tokens: mx.array) -> None:
        """Rows (``hidden`` [1, T, H], their next ``tokens``) wait for the head; None: one row the head never
        sees (a plain stretch's row before its window), counted in ``skipped``."""
        if not self.tracked:
            return
        if hidden is None:
            self.skipped += 1
            return
        self._hidden.append(hidden)
        self._tokens.append(tokens.reshape(-1))

    def wait_only(self, hidden: mx.array, tokens: mx.array) -> None:
        """The rows waiting are exactly these (the state after a round a chained one was built on, put back:
        ``engine.ahead.ChainedRound``; the head took them in on the device, at positions it now forgets)."""
        self._hidden, self._tokens = [], []
        self.wait(hidden, tokens)

    def flush(self) -> mx.array | None:
        """Commit the waiting rows to the head's cache in one call; returns the head's output (None: none
        waited)."""
        if not self._hidden:
            return None
        hidden = mx.concatenate(self._hidden, axis=1)
        tokens = mx.concatenate(self._tokens)[None]
        self._hidden, self._tokens = [], []
        return self.module(self.embed(tokens), hidden, self.cache)

    def flush_async(self) -> None:
        """A long plain stretch keeps the head current in batches, evaluated off the token path."""
        out = self.flush()
        mx.async_eval(out, self.cache.state)

    def keep_window(self, rows: int) -> None:
        """Only the last ``rows`` waiting rows stay (a plain stretch the head need not take in)."""
        if len(self._hidden) > rows:
            dropped = self._hidden[:-rows] if rows else self._hidden
            self.skipped += sum(h.shape[1] for h in dropped)
            del self._hidden[: len(dropped)], self._tokens[: len(dropped)]

    def next_draft(self, token: mx.array, out: mx.array) -> mx.array:
        """The head chained on its own draft ``token`` [1] (a speculative entry, dropped by ``drop``)."""
        return self.module(self.embed(token[None]), out, self.cache)

    def drop(self, entries: int) -> None:
        """Drop the last ``entries`` (a round's speculative ones)."""
        self.cache.trim(entries)

    def restore(self, positions: int, cache: KVCache | None, row: mx.array | None, next_token: int) -> None:
        """The backbone's caches were restored to ``positions`` (a prefix cache's): ``cache`` holds the head's
        entries for positions 0..positions-2 and ``row`` the hidden of position positions-1, which waits for
        ``next_token``; without them the head starts with a gap of ``positions`` rows."""
        if not self.tracked:
            return
        if cache is None or row is None:
            self.skipped = positions
            return
        if cache.offset != positions - 1:
            raise ValueError(f"the head cache holds {cache.offset} entries, a prefix of {positions} needs {positions - 1}")
        self.cache = cache
        self.wait(row, mx.array([next_token], dtype=mx.uint32))

    def fed_through(self, positions: int) -> tuple[KVCache, mx.array] | None:
        """Where the head was fed every one of ``positions`` (no gap): its cache holding entries
        0..positions-2 (the waiting rows but the last taken in) and the hidden of position positions-1, for a
        prefix cache to store with the reply; None where it was not."""
        waiting = self.waiting
        if not (self.tracked and self.skipped == 0 and waiting and self.cache.offset + waiting == positions):
            return None
        hidden = mx.concatenate(self._hidden, axis=1)
        tokens = mx.concatenate(self._tokens)
        if waiting > 1:
            self.module(self.embed(tokens[None, :-1]), hidden[:, :-1], self.cache)
        self._hidden, self._tokens = [hidden[:, -1:]], [tokens[-1:]]
        return self.cache, hidden[:, -1:]

    def check(self, positions: int) -> None:
        """Assert the invariant against the backbone caches' ``positions``."""
        if not self.tracked:
            return
        waiting = self.waiting
        assert waiting == sum(t.shape[0] for t in self._tokens)
        covered = self.cache.offset + waiting + self.skipped
        assert covered == positions, f"the head covers {covered} positions, the caches {positions}"
