"""How the generation loop runs the backbone: here (``LocalForward``) or through a pipeline of stages on
other processes and machines (``exo.engine.pipeline.PipelineForward``). The loop in ``generate.py`` is the
same for both: it asks for the post-norm hiddens of some rows, and after a verify call says how many
rows to keep. Everything speculative (drafting, acceptance, the head's cache) stays in the loop, on the
process that holds the last stage.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

import mlx.core as mx

from .batch_cache import batch_cache, keep_rows_per_sequence, prompt_row, prompt_rows
from .models.backbone import SpeculativeBackbone
from .models.layers import MoEVerifyMode, RollbackArraysCache
from .verify import VerifyMode

# A verify call cannot be built while the previous round computes (its drafts need that round's verdict),
# so on MLX's CPU backend, whose stream thread computes while the host builds, it is evaluated two layers
# at a time as it is built (rounds took less time). On a GPU the extra evaluations cost 0-10% on an H100's
# demo models (docs/performance.md, "The engine's constants"), so off there; at 9B on an H200 the host builds a
# K = 1 verify call for 4.5 ms of a 12.4 ms round while the device waits (bench/round_phases.py): started every
# few layers, the device computes the first layers while the host builds the rest. ``EXO_VERIFY_EVAL_EVERY``
# (layers; 0: one evaluation) sets it for the device the process runs on; ``bench/round_phases.py
# --verify-eval-every`` compares settings in one run. Plain steps are pipelined across steps already.
VERIFY_EVAL_EVERY = 2  # on MLX's CPU backend
VERIFY_EVAL_EVERY_GPU = 0


def _verify_eval_every_from_env() -> int | None:
    value = os.environ.get("EXO_VERIFY_EVAL_EVERY", "").strip()
    if not value:
        return None
    try:
        every = int(value)
    except ValueError:
        raise ValueError(f"EXO_VERIFY_EVAL_EVERY must be a whole number of layers (0: off), not {value!r}") from None
    if every < 0:
        raise ValueError(f"EXO_VERIFY_EVAL_EVERY must be 0 or more layers, not {every}")
    return every


def verify_eval_every() -> int:
    """How many layers a verify call builds between evaluations on the default device (0: one evaluation)."""
    every = _verify_eval_every_from_env()
    if every is not None:
        return every
    return VERIFY_EVAL_EVERY if mx.default_device() == mx.cpu else VERIFY_EVAL_EVERY_GPU


# A prompt chunk on a GPU: the host builds a 9B-shaped model's graph in ~16 ms, while the device waits for its
# first kernel, and a 554-row chunk then computes for ~90 ms (an H200: bench/prefill.py --profile-context). Started
# every few layers as it is built, the device computes the first layers while the host builds the rest. Small
# calls (decode steps, verify rows, batch steps) stay one evaluation: their graphs are mostly the host's work.
PROMPT_EVAL_EVERY = 4
PROMPT_EVAL_MIN_ROWS = 256


def _on_gpu() -> bool:
    return mx.default_device() == mx.gpu


def prompt_eval_every(rows: int) -> int:
    """How many layers a forward call of ``rows`` rows (not a verify) builds between evaluations (0: one)."""
    return PROMPT_EVAL_EVERY if _on_gpu() and rows >= PROMPT_EVAL_MIN_ROWS else 0

# The MoE verify mode on the wire of a pipeline (a header field): 0 is "not a verify call".
MOE_MODES: tuple[MoEVerifyMode, ...] = ("route_locked", "batched", "safe")
class Forward(Protocol):
    """The backbone as the generation loop sees it."""

    stages: int  # 1 on a single node
    mode: str  # how the model is split: "single_node", "pipeline" (by layers) or "tensor" (NativeMTPStats.mode)
    verify: VerifyMode  # how verify calls compute their rows (the engine sets it from its probe)

    def new_cache(self) -> list[Any]:
        """Fresh caches for a request (this process's layers)."""
        ...

    def hidden(self, tokens: mx.array, cache: list[Any], *, verify: bool = False) -> mx.array:
        """Post-final-norm hiddens [1, T, H] of ``tokens`` [1, T]. ``verify``: GatedDeltaNet layers record
        their state after every row and MoE routing is locked to decode's, so ``rollback`` can keep any
        prefix of the rows."""
        ...

    def rollback(self, cache: list[Any], rows: int, kept: int) -> None:
        """After a verify call of ``rows`` rows, keep the first ``kept`` (attention KV trimmed, GatedDeltaNet
        state committed), everywhere the backbone's layers are."""
        ...

    def end(self, cache: list[Any]) -> None:
        """The request (or batch) is over (finished, cancelled or failed): nothing of these caches may survive
        anywhere."""
        ...

    def memory_rates(self) -> list[tuple[int, int]]:
        """Per stage (one on a single node; the leader last): (bytes of attention KV per token, bytes of
        recurrent state per sequence) of that stage's layers, measured there on a one-token forward."""
        ...

    # -- what a batch (engine/batch.py) does to its caches, everywhere the backbone's layers are -----------
    def join(self, batch: list[Any] | None, member: list[Any]) -> list[Any]:
        """One sequence's caches (at a step boundary) join ``batch`` (None: the batch is made of them) as its
        last row; returns the batch's caches. ``member`` is the batch's from now on."""
        ...

    def filter(self, cache: list[Any], keep: Sequence[int]) -> None:
        """A batch keeps these rows, in this order (members left; at least one stays: else ``end``)."""
        ...

    def rollback_per_sequence(self, cache: list[Any], rows: int, kept: Sequence[int]) -> None:
        """After a batched verify call of ``rows`` rows per sequence, sequence b keeps its first ``kept[b]``."""
        ...

    def set_batch_invariant(self, on: bool) -> None:
        """Around a batch's step: every layer computes each sequence's rows as its solo step would."""
        ...

    # -- prompts prefilled as rows of one call (engine/batch_prefill.py), everywhere the layers are -----------------
    def prompt_rows(self, lengths: Sequence[int], owners: Sequence[list[Any]]) -> list[Any]:
        """Fresh caches for one call of prompts of ``lengths`` as rows, right-padded to the longest (each row's
        padding leaves its states); ``owners``: the sequences' own (fresh) caches, in row order."""
        ...

    def split_rows(self, cache: list[Any], lengths: Sequence[int], owners: Sequence[list[Any]]) -> list[list[Any]]:
        """After that call: row b of ``cache`` (its first ``lengths[b]`` positions) as sequence b's caches, in
        place of ``owners[b]``; ``cache`` is gone."""
        ...


def verify_call(model: SpeculativeBackbone, cache: list[Any], mode: VerifyMode, rows: int | None = None):
    """Context for building one verify call on a model's (stage's) layers: GatedDeltaNet recording,
    MoE routing locked, attention per row where this device needs it (``verify.probe``); ``rows``: the call's
    rows, all sequences together (None: unknown)."""
    return _VerifyCall(model, cache, mode, rows)


class _VerifyCall:
    def __init__(self, model: SpeculativeBackbone, cache: list[Any], mode: VerifyMode, rows: int | None) -> None:
        self.model, self.cache, self.mode, self.rows = model, cache, mode, rows

    def __enter__(self) -> None:
        for c in self.cache:
            if isinstance(c, RollbackArraysCache):
                c.recording = True
        self.model.set_verify_mode(self.mode.moe, self.mode.per_row_attention, self.rows)

    def __exit__(self, *exc: object) -> None:
        self.model.set_verify_mode(None, False)
        for c in self.cache:
            if isinstance(c, RollbackArraysCache):
                c.recording = False


def keep_rows(cache: list[Any], rows: int, kept: int) -> None:
    """Roll a stage's caches back to the first ``kept`` rows of their last verify call of ``rows`` rows."""
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            c.commit(kept)
        else:
            c.trim(rows - kept)


def cache_rates(model: SpeculativeBackbone) -> tuple[int, int]:
    """(bytes of attention KV per token, bytes of recurrent state per sequence) of ``model``'s layers (a
    stage's), measured on a one-token forward of caches made for it and dropped after."""
    x = (mx.array([[0]], dtype=mx.uint32) if model.first_stage
         else mx.zeros((1, 1, model.hidden_size), dtype=model.stage_layers[0].input_layernorm.weight.dtype))
    cache = model.make_cache()
    mx.eval(model.stage_hidden(x, cache))
    per_token = per_sequence = 0
    for c in cache:
        if isinstance(c, RollbackArraysCache):
            per_sequence += sum(a.nbytes for a in c.cache if a is not None)
        else:
            per_token += (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]
    return per_token, per_sequence


class LocalForward:
    """The whole backbone in this process."""

    stages = 1
    mode = "single_node"

    def __init__(self, model: SpeculativeBackbone, verify: VerifyMode | None = None) -> None:
        self.model = model
        self.verify = verify or VerifyMode()  # the engine replaces it with its probed mode

    def new_cache(self) -> list[Any]:
        return self.model.make_cache()

    def hidden(self, tokens: mx.array, cache: list[Any], *, verify: bool = False, lazy: bool = False) -> mx.array:
        """``lazy``: a verify call built ahead of its round (``engine.ahead``): nothing of it starts evaluating
        as it is built (``verify_eval_every``), it may never run."""
        if not verify:
            return self.model.stage_hidden(tokens, cache, eval_every=prompt_eval_every(tokens.size))
        with verify_call(self.model, cache, self.verify, tokens.size):
            return self.model.stage_hidden(tokens, cache, eval_every=0 if lazy else verify_eval_every())

    def rollback(self, cache: list[Any], rows: int, kept: int) -> None:
        keep_rows(cache, rows, kept)

    def end(self, cache: list[Any]) -> None:
        """Nothing to do: the caches die with the request."""

    def memory_rates(self) -> list[tuple[int, int]]:
        return [cache_rates(self.model)]

    def join(self, batch: list[Any] | None, member: list[Any]) -> list[Any]:
        theirs = [batch_cache(c) for c in member]
        if not batch:
            return theirs
        for mine, c in zip(batch, theirs, strict=True):
            mine.extend(c)
        return batch

    def filter(self, cache: list[Any], keep: Sequence[int]) -> None:
        index = mx.array(list(keep))
        for c in cache:
            c.filter(index)

    def rollback_per_sequence(self, cache: list[Any], rows: int, kept: Sequence[int]) -> None:
        keep_rows_per_sequence(cache, rows, kept)

    def set_batch_invariant(self, on: bool) -> None:
        self.model.set_batch_invariant(on)

    def prompt_rows(self, lengths: Sequence[int], owners: Sequence[list[Any]]) -> list[Any]:
        return prompt_rows(self.model.make_cache(), lengths)

    def split_rows(self, cache: list[Any], lengths: Sequence[int], owners: Sequence[list[Any]]) -> list[list[Any]]:
        return [prompt_row(cache, b, n) for b, n in enumerate(lengths)]
