"""A batch's caches: one sequence's caches as rows of a batch, and the per-sequence rollback after a
batched verify call.

Attention KV lives in mlx-lm's left-padded ``BatchKVCache`` (every sequence's keys end at the same index;
``left_padding`` masks what is before a sequence's first token), GatedDeltaNet conv window and recurrent
state in a ``RollbackArraysCache`` with a row per sequence (no padding: every sequence feeds as many rows
to every call).

After a verify call of R rows per sequence, sequence b keeps its first ``kept[b]`` rows:
- GatedDeltaNet: each sequence's state and conv window are gathered from the recorded state after its
  own kept row (``RollbackArraysCache.commit`` with a count per row);
- attention: the rows no sequence keeps are trimmed from all (``trim(R - max(kept))``); a sequence that
  keeps fewer has ``max(kept) - kept[b]`` rejected rows at the end of its keys, which become left padding:
  its keys roll right by that many (``prepare(right_padding=...)`` + ``finalize()``, mlx-lm's
  ``dynamic_roll``), its ``left_padding`` grows and its ``offset`` (RoPE position) drops by as many. The
  rolled-out rejected rows land past the end (overwritten by the next call) or in the padding (masked);
- then the padding every sequence has is cut off the front (``compact``), so the keys stay as long as the
  longest sequence's: a batch's KV never outgrows its members' horizons (``batch_memory.batch_bytes``).

``BatchCaches`` holds the caches a batch steps on: its one member's own until a second joins, then rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from .models.layers import RollbackArraysCache

if TYPE_CHECKING:
    from .forward import Forward
    from .sequence import SequenceState


def batch_cache(cache: Any) -> Any:
    """One sequence's cache as a batch cache of one row."""
    if isinstance(cache, RollbackArraysCache):
        batched = RollbackArraysCache()
        batched.cache = [cache[0], cache[1]]
        return batched
    if isinstance(cache, KVCache):
        return BatchKVCache.merge([cache])
    raise TypeError(f"cannot batch a {type(cache).__name__}")


def batch_row(cache: list[Any], index: int) -> list[Any]:
    """Row ``index`` of a batch's caches as one sequence's caches (views, nothing copied): attention KV
    without the row's left padding (``KVCache``, offset its own positions), the row's GatedDeltaNet state.
    What a member leaving the batch stores in the prefix cache before ``filter`` drops its row."""
    pad: int | None = None
    out: list[Any] = []
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            row = RollbackArraysCache()
            row.cache = [c[0][index : index + 1], c[1][index : index + 1]]
        elif isinstance(c, BatchKVCache):
            if pad is None:
                pad = int(c.left_padding[index].item())  # every attention layer pads alike
            row = KVCache()
            row.keys = c.keys[index : index + 1, :, pad : c._idx]
            row.values = c.values[index : index + 1, :, pad : c._idx]
            row.offset = c._idx - pad
        else:
            raise TypeError(f"cannot take a row of a {type(c).__name__}")
        out.append(row)
    return out


def prompt_rows(cache: list[Any], lengths: Sequence[int]) -> list[Any]:
    """Fresh caches (``make_cache``'s) made ready for prompts of ``lengths`` as rows of one call, right-padded to the
    longest (``engine.batch_prefill``): each GatedDeltaNet layer takes each row's length, so the padding after a
    row leaves its recurrent state and conv window as its own prompt left them (mlx-lm's masked path)."""
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.lengths = mx.array(list(lengths))
    return cache


def prompt_row(cache: list[Any], b: int, n: int) -> list[Any]:
    """Row ``b`` of caches a call of prompts as rows filled (``prompt_rows``) as one sequence's own: its first ``n``
    positions (views of the shared buffers, the padding left out)."""
    out: list[Any] = []
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            row = RollbackArraysCache()
            row.cache = [c[0][b : b + 1], c[1][b : b + 1]]
        elif isinstance(c, KVCache):
            row = KVCache()
            row.keys = c.keys[b : b + 1, :, :n]
            row.values = c.values[b : b + 1, :, :n]
            row.offset = n
        else:
            raise TypeError(f"cannot take a row of a {type(c).__name__}")
        out.append(row)
    return out


def keep_rows_per_sequence(cache: list[Any], rows: int, kept: Sequence[int]) -> None:
    """After a batched verify call of ``rows`` rows per sequence, keep the first ``kept[b]`` rows of
    sequence b (0..rows) in every layer's cache."""
    top = max(kept)
    extra = [top - k for k in kept]
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.commit(list(kept))
        elif isinstance(c, BatchKVCache):
            c.trim(rows - top)
            if any(extra):
                c.prepare(right_padding=extra)
                c.finalize()
        else:
            raise TypeError(f"cannot roll back a {type(c).__name__} per sequence")
    compact(cache)


def compact(cache: list[Any]) -> None:
    """Cut the left padding that every sequence has off the front of the attention caches."""
    kv = [c for c in cache if isinstance(c, BatchKVCache) and c.keys is not None]
    if not kv:
        return
    lead = min(kv[0].left_padding.tolist())  # every attention layer pads alike
    if lead <= 0:
        return
    for c in kv:
        c.keys = c.keys[..., lead:, :]
        c.values = c.values[..., lead:, :]
        c._idx -= lead
        c.left_padding = c.left_padding - lead


class BatchCaches:
    """The backbone caches a batch steps on, wherever the layers are: its first member's own (a batch of one
    steps on them in place: what a solo step costs) until a second member joins; then a batch's rows
    (``forward.join``), until the last member leaves."""

    def __init__(self, forward: Forward) -> None:
        self.forward = forward
        self.cache: list[Any] = []
        self.rows = False  # a batch's rows (else: the one member's own caches)

    def join(self, members: list[SequenceState], run: SequenceState) -> None:
        """``run`` joins ``members``: its caches become the batch's last row (the first member's stay its own)."""
        if not members:
            self.cache = run.cache
            return
        if not self.rows:  # a second member: the first one's caches become the batch's first row
            self.cache = self.forward.join(None, members[0].hand_caches())
            self.rows = True
        self.cache = self.forward.join(self.cache, run.hand_caches())

    def keep(self, members: list[SequenceState], keep: list[int]) -> None:
        """The members at ``keep`` stay, in that order (the last one leaving drops the caches)."""
        if not self.rows:
            if not keep:
                self.cache = []
                for run in members:
                    run.release()  # the lone member's own caches
            return
        if not keep:
            cache, self.cache, self.rows = self.cache, [], False
            self.forward.end(cache)
            return
        self.forward.filter(self.cache, keep)

    def rollback(self, rows: int, kept: list[int]) -> None:
        """After a verify call of ``rows`` rows per member, member b keeps its first ``kept[b]``."""
        if self.rows:
            self.forward.rollback_per_sequence(self.cache, rows, kept)
        else:
            self.forward.rollback(self.cache, rows, kept[0])

    def member(self, i: int) -> tuple[list[Any], list[Any], int]:
        """Member ``i``'s caches as one sequence's (its row: views, nothing copied), the caches that hold them
        and its row there (-1: its own)."""
        if self.rows:
            return batch_row(self.cache, i), self.cache, i
        return self.cache, self.cache, -1

    def positions(self, members: int) -> list[int | None]:
        """Each member's positions, read from its row of the attention KV (left padding excluded)."""
        kv = next((c for c in self.cache if isinstance(c, BatchKVCache)), None) if self.rows else None
        return kv.offset.tolist() if kv is not None else [None] * members
