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
inside).

On a pipeline (or a tensor group) the call's step header carries a ``PREFILL_ROWS`` op record: each row's length
and the slot of the sequence that owns it (``Forward.prompt_rows``). Every other stage makes the call's caches with
those lengths, runs the step, and hands row b to sequence b's slot right after it (``Forward.split_rows`` on the
leader, ``StageSlots.split_rows`` there), where the stage's prefix cache finds it as after that sequence's own
prefill (``StagePrefix.step``).
"""

from __future__ import annotations

import time

import mlx.core as mx

from .generate import Engine
from .memory import out_of_memory
from .sequence import SequenceState


def can_prefill_together(engine: Engine) -> bool:
    """Whether ``engine``'s sequences may prefill as rows of one call (rows not forced to round as alone; on one
    node, a pipeline's stages or a tensor group's members alike)."""
    return not engine.config.batch_invariant


def prefill_together(runs: list[SequenceState]) -> None:
    """Prefill every run's whole prompt (each ``whole_prompt_in`` its length) in one backbone call; each run is
    then where its own ``prefill`` leaves it (``first_token`` next)."""
    engine = runs[0].engine
    if any(run.engine is not engine for run in runs) or not can_prefill_together(engine):
        raise ValueError("runs prefill together on one engine whose rows may round as a batch's")
    prompts = [list(run.request.prompt_tokens) for run in runs]
    lengths = [len(p) for p in prompts]
    if not all(run.whole_prompt_in(n) for run, n in zip(runs, lengths, strict=True)):
        raise ValueError("only whole prompts from position 0 prefill together")
    longest = max(lengths)
    tokens = mx.array([p + [0] * (longest - len(p)) for p in prompts], dtype=mx.uint32)
    started = time.perf_counter()
    owners = [run.cache for run in runs]
    cache = engine.forward.prompt_rows(lengths, owners)  # (a pipeline's stages are told each row's length and owner)
    with out_of_memory(f"prefilling {len(runs)} prompts of up to {longest} tokens together"):
        hidden = engine.forward.hidden(tokens, cache)  # (a GPU's forward evaluates layers as it builds them)
    rows = engine.forward.split_rows(cache, lengths, owners)
    for b, (run, n, row) in enumerate(zip(runs, lengths, rows, strict=True)):
        run.prefill_with(row, hidden[b : b + 1, :n], started)
