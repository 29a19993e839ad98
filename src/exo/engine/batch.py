"""Continuous batching: plain decode steps for several generation runs of one model at once.

A run (``_Run``) prefills and emits its first token alone (``_Run.begin``: the same computation as a solo
request, so its first token is the solo one), or leaves a solo loop at a step boundary
(``GenerationRequest.yield_to_batch``). ``BatchDecoder.add`` then moves its caches into the batch's: the
attention KV into mlx-lm's left-padded ``BatchKVCache``, the GatedDeltaNet conv window and recurrent
state (one row per sequence, no padding needed for one-token steps) into an ``ArraysCache``. Each
``step`` runs ONE backbone call over a row per run; each row is then penalised and sampled with its own
run's parameters and PRNG key stream (a seed reproduces the solo samples), and emitted through the
run's own output (stop strings, EOS, max_tokens, cancellation). Finished and cancelled runs leave the
batch at the step's end; new runs join between steps.

Steps are pipelined like a solo plain burst: a step's next tokens are computed while the host emits the
tokens fed to it. A run that finishes has one wasted row computed after its last token.

Memory: a batch's attention KV is left-padded to its longest row, so n runs hold about n x the longest
horizon (prompt + max_tokens) of KV rows, plus each run's GatedDeltaNet state (fixed per sequence).
``batch_bytes`` is that estimate, ``sequence_bytes`` measures its two rates on the model itself; the device
queue admits a run into a batch only while the estimate stays within the instance's KV budget.

Native MTP does not run inside a batch yet (a request's stats say so, with the batch sizes it ran in).
On this CPU batched rows round exactly as solo decoding (bench/batching.py measures it; tests check it).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from .generate import Engine, GenerationChunk, _Run
from .models.layers import RollbackArraysCache
from .sampling import apply_processors


def sequence_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of attention KV per token, bytes of recurrent state per sequence) of ``engine``'s model,
    measured once on a one-token forward (on the device thread) and kept on the engine."""
    measured = getattr(engine, "_sequence_bytes", None)
    if measured is None:
        cache = engine.forward.new_cache()
        mx.eval(engine.forward.hidden(mx.array([[0]], dtype=mx.uint32), cache))
        per_token = per_sequence = 0
        for c in cache:
            if isinstance(c, KVCache):
                per_token += (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
            else:
                per_sequence += sum(a.nbytes for a in c.cache if a is not None)
        measured = engine._sequence_bytes = (per_token, per_sequence)  # type: ignore[attr-defined]
    return measured


def batch_bytes(horizons: list[int], per_token: int, per_sequence: int) -> int:
    """The memory a batch of runs with these horizons (prompt + max_tokens each) may reach: every row
    padded to the longest, plus each run's recurrent state."""
    if not horizons:
        return 0
    return len(horizons) * (max(horizons) * per_token + per_sequence)


def batch_fits(engine: Engine, horizons: list[int], budget_tokens: int) -> bool:
    """Whether runs with these horizons may decode together within ``budget_tokens`` tokens of the model's
    KV (a lone run always may: its own context limit bounds it)."""
    if len(horizons) < 2:
        return True
    per_token, per_sequence = sequence_bytes(engine)
    if per_token == 0:  # no attention layer: only the fixed states, which max_batch bounds
        return True
    return batch_bytes(horizons, per_token, per_sequence) <= budget_tokens * per_token


class BatchDecoder:
    """The runs decoding together on one engine (one device thread drives it)."""

    def __init__(self, engine: Engine) -> None:
        if engine.forward.stages != 1:
            raise ValueError("pipelined models do not batch yet")
        self.engine = engine
        self.runs: list[_Run] = []
        self.cache: list[Any] = []

    def __len__(self) -> int:
        return len(self.runs)

    def add(self, run: _Run) -> None:
        """A run at a step boundary (after ``begin()`` or a handover, not finished) joins the batch."""
        if run.engine is not self.engine:
            raise ValueError("a batch decodes the runs of one engine")
        if not run.batchable:
            raise ValueError("this run cannot decode in a batch (grammar, logprobs or a pipelined model)")
        if run.output.finish is not None or run.pending_token is None:
            raise ValueError("only a started, unfinished run can join a batch")
        cache = [_batch_cache(c) for c in run.cache]
        if not self.runs:
            self.cache = cache
        else:
            for mine, theirs in zip(self.cache, cache, strict=True):
                mine.extend(theirs)
        run.cache = []  # the batch holds its state now
        # The MTP head is not fed in a batch: what was waiting for it is dropped.
        run.track_head = False
        run._head_hidden, run._head_tokens = [], []
        run.pending_emitted = True
        self.runs.append(run)

    def step(self) -> list[tuple[_Run, list[GenerationChunk]]]:
        """One decode step of every run: the chunks each run emits (a finished run's last is its final
        chunk, with stats; it has left the batch)."""
        runs = self.runs
        size = len(runs)
        if not size:
            return []
        inputs = mx.concatenate([r.pending_token.reshape(1) for r in runs])  # type: ignore[union-attr]
        hidden = self.engine.forward.hidden(inputs[:, None], self.cache)
        logits = self.engine.model.logits(hidden)[:, -1]  # [B, V]
        greedy: mx.array | None = None
        following: list[mx.array] = []
        for i, run in enumerate(runs):
            if run.params.greedy and not run.processors:
                if greedy is None:
                    greedy = mx.argmax(logits, axis=-1).astype(mx.uint32)
                following.append(greedy[i : i + 1])
            else:
                row = logits[i : i + 1]
                if run.processors:
                    row = apply_processors(run.processors, run.history, row)
                token, _ = run._sample(row)
                following.append(token)
        mx.async_eval(following)
        values = inputs.tolist()  # the tokens fed to this step, read while it runs
        out: list[tuple[_Run, list[GenerationChunk]]] = []
        keep: list[int] = []
        for i, run in enumerate(runs):
            chunks: list[GenerationChunk] = []
            if not run.pending_emitted:
                # Counted per token, by the size of the step that computed it.
                run.batch_sizes[run.pending_batch] = run.batch_sizes.get(run.pending_batch, 0) + 1
                run.output.add(values[i])
                chunks.extend(run._drain())
            if run.output.finish is None:
                run._cancelled()
            if run.output.finish is not None:
                chunks.append(run.final_chunk())
            else:
                keep.append(i)
                run.pending_token = following[i]
                run.pending_emitted = False
                run.pending_batch = size
                if run.processors:
                    run.history = mx.concatenate([run.history, following[i]])
            out.append((run, chunks))
        if len(keep) < size:
            self._keep(keep)
        return out

    def cancel_all(self) -> list[tuple[_Run, GenerationChunk]]:
        """End every run now (the device shuts down): each one's final chunk, finish "cancelled"."""
        out = []
        for run in self.runs:
            run.output.finish = run.output.finish or "cancelled"
            out.append((run, run.final_chunk()))
        self._keep([])
        return out

    def _keep(self, keep: list[int]) -> None:
        self.runs = [self.runs[i] for i in keep]
        if not keep:
            self.cache = []
            return
        index = mx.array(keep)
        for c in self.cache:
            c.filter(index)


def _batch_cache(cache: Any) -> Any:
    """One sequence's cache as a batch cache of one row."""
    if isinstance(cache, RollbackArraysCache):
        batched = ArraysCache(2)
        batched.cache = [cache[0], cache[1]]
        return batched
    if isinstance(cache, KVCache):
        return BatchKVCache.merge([cache])
    raise TypeError(f"cannot batch a {type(cache).__name__}")
