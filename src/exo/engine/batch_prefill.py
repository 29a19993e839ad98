"""Several sequences' prompts through the backbone in ONE call: the newcomers a step of the serving scheduler
admits together (``runner.scheduler``) prefill as rows of one forward instead of one forward each.

The prompts are right-padded to the longest: row b holds sequence b's tokens from position 0, then padding.
Causal attention keeps every real row from seeing the padding after it, and the GatedDeltaNet layers take
each row's length (``ArraysCache.lengths``: the padding leaves the recurrent state untouched and the conv
window is taken at the row's own end, mlx-lm's masked path), so each row computes what its solo prefill
does. On this CPU every row is bit for bit its solo prefill (hidden states, attention KV, recurrent states;
dense, MoE and Qwen3-Next, float32 and bfloat16: tests/engine/test_batch_prefill.py); on a GPU a block of
rows may round unlike one prompt's (as batched decode steps do), unless ``batch_invariant``, where this is
not used. Then every sequence takes its row as its own caches (``SequenceState.prefill_with``: views of
the shared buffers, the padding left out) and goes on as after its own prefill (snapshots for the prefix
cache, the MTP head's rows, the first token).

A host-bound device pays a forward's graph once for all of them rather than once each: with GatedDeltaNet
stepped token by token (mlx-lm's path on MLX CUDA, host-bound: docs/performance.md, "The code's reasons"), short prompts
together cost about one prompt's time, where one after the other each costs its own. Only whole prompts from position
0 go together (``SequenceState.whole_prompt_in``: nothing restored from the prefix cache, no snapshot edge
inside), on a single node (a pipeline's stages would need each row's length: not carried).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .generate import Engine
from .memory import out_of_memory
from .models.layers import RollbackArraysCache
from .sequence import SequenceState


def can_prefill_together(engine: Engine) -> bool:
    """Whether ``engine``'s sequences may prefill as rows of one call (a single node, rows not forced to round
    as alone)."""
    return engine.forward.stages == 1 and not engine.config.batch_invariant


def prefill_together(runs: list[SequenceState]) -> None:
    """Prefill every run's whole prompt (each ``whole_prompt_in`` its length) in one backbone call; each run is
    then where its own ``prefill`` leaves it (``first_token`` next)."""
    engine = runs[0].engine
    if any(run.engine is not engine for run in runs) or not can_prefill_together(engine):
        raise ValueError("runs prefill together on one single-node engine")
    prompts = [list(run.request.prompt_tokens) for run in runs]
    lengths = [len(p) for p in prompts]
    if not all(run.whole_prompt_in(n) for run, n in zip(runs, lengths, strict=True)):
        raise ValueError("only whole prompts from position 0 prefill together")
    longest = max(lengths)
    tokens = mx.array([p + [0] * (longest - len(p)) for p in prompts], dtype=mx.uint32)
    started = time.perf_counter()
    cache = engine.forward.new_cache()
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.lengths = mx.array(lengths)  # each row's own length: the padding after it leaves its state
    with out_of_memory(f"prefilling {len(runs)} prompts of up to {longest} tokens together"):
        hidden = engine.forward.hidden(tokens, cache)  # (a GPU's forward evaluates layers as it builds them)
    for b, (run, n) in enumerate(zip(runs, lengths, strict=True)):
        run.prefill_with(_row(cache, b, n), hidden[b : b + 1, :n], started)


def _row(cache: list[Any], b: int, n: int) -> list[Any]:
    """Row ``b`` of the shared caches as one sequence's own, its first ``n`` positions (views)."""
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
