"""Sampling distributions and speculative acceptance.

Plain sampling and speculative verification use the SAME filtered distribution (mlx-lm's filters in
mlx-lm's order: top_p, min_p, top_k on the log-probabilities, then temperature), so MTP sampling
produces exactly the output distribution of plain sampling (Leviathan et al. 2023, Chen et al. 2023).
All ratios are computed in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float | None = None  # multiplicative, mlx-lm semantics (last 20 tokens)
    presence_penalty: float = 0.0  # OpenAI semantics, over the completion so far
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature <= 100.0:
            raise SamplingParamsError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty is not None and not 0.0 < self.repetition_penalty <= 10.0:
            raise SamplingParamsError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamsError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(
            (self.repetition_penalty not in (None, 1.0)) or self.presence_penalty or self.frequency_penalty
        )


def make_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """mlx-lm's logits processors for the penalties (applied before any filter)."""
    completion_window = 1 << 30  # OpenAI's presence/frequency penalties see the whole completion
    return make_logits_processors(
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=completion_window,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=completion_window,
    )


PENALISED_LOGIT_BOUND = 1e30  # a penalty that sends a logit past this has made its token certain (or impossible)


def apply_processors(processors: list[LogitsProcessor], history: mx.array, logits: mx.array) -> mx.array:
    """Penalised logits [1, V] given the completion so far (``history``, 1-D).

    A repetition penalty near 0 (any value in (0, 10] is valid) divides a positive logit into infinity (and 0 by
    0 into NaN): the result is bounded to +-``PENALISED_LOGIT_BOUND`` (NaN as 0), so the distribution stays a
    distribution (the overflowing tokens share the mass) and log-probabilities stay finite."""
    for processor in processors:
        logits = processor(history, logits)
    bound = PENALISED_LOGIT_BOUND
    return mx.clip(mx.nan_to_num(logits, nan=0.0, posinf=bound, neginf=-bound), -bound, bound)


def filtered_logprobs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Normalised float32 log-probabilities [..., V] that plain sampling draws from (temperature > 0)."""
    logprobs = logits.astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    vocab = logprobs.shape[-1]
    if 0.0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p > 0.0:
        logprobs = apply_min_p(logprobs, params.min_p)
    if 0 < params.top_k < vocab:
        logprobs = apply_top_k(logprobs, params.top_k)
    logprobs = logprobs * (1.0 / params.temperature)
    return logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)


class KeyStream:
    """Explicit PRNG keys for one request, so a seed reproduces its samples."""

    def __init__(self, seed: int | None):
        if seed is None:
            import secrets

            seed = secrets.randbits(63)
        self._key = mx.random.key(seed)

    def next(self) -> mx.array:
        self._key, key = mx.random.split(self._key)
        return key


def select_token(logits: mx.array, params: SamplingParams, keys: KeyStream) -> tuple[mx.array, mx.array | None]:
    """One token per row of ``logits`` [N, V]: argmax, or a draw from the filtered distribution.

    Returns (tokens [N] uint32, logprobs [N, V] or None for greedy).
    """
    if params.greedy:
        return mx.argmax(logits, axis=-1), None
    logprobs = filtered_logprobs(logits, params)
    return mx.random.categorical(logprobs, axis=-1, key=keys.next()), logprobs


@dataclass(frozen=True)
class Verdict:
    """Lazy device arrays deciding one speculative round (read back with one host sync)."""

    accepted: mx.array  # [K] bool: draft i passes its test (meaningful up to the first False)
    replacement: mx.array  # [K+1] the token emitted after i accepted drafts (correction or bonus)
    decided: mx.array | None = None  # [K+1] bool: the row's choice does not hinge on a near tie


def greedy_verdict(target_logits: mx.array, drafts: mx.array, tie_margin: float = 0.0) -> Verdict:
    """Accept while the target's argmax equals the draft; emit the target's argmax after.

    With ``tie_margin`` > 0, a row whose top two logits are closer than ``tie_margin * max(|top1|, 1)``
    is marked undecided: on GPUs a multi-row matmul does not round like decode's one-row matmul, so
    such a row could pick another token than plain decoding would (the engine then decodes that
    position plainly).
    """
    targets = mx.argmax(target_logits, axis=-1)  # [K+1]
    decided = None
    if tie_margin > 0.0:
        first, second = top_two(target_logits, targets)
        decided = (first - second) > tie_margin * mx.maximum(mx.abs(first), 1.0)
    return Verdict(accepted=targets[:-1] == drafts, replacement=targets, decided=decided)


def top_two(logits: mx.array, argmax: mx.array) -> tuple[mx.array, mx.array]:
    """The largest and second-largest logit of each row (float32; equal where the maximum occurs twice), given
    the rows' argmax: two reductions, where ``mx.topk`` partitions the vocabulary (a sort on MLX CUDA)."""
    values = logits.astype(mx.float32)
    first = mx.max(values, axis=-1)
    others = mx.where(mx.arange(values.shape[-1]) == argmax[..., None], -mx.inf, values)
    return first, mx.max(others, axis=-1)


def sampling_verdict(
    target_logprobs: mx.array, draft_logprobs: mx.array, drafts: mx.array, keys: KeyStream
) -> Verdict:
    """Leviathan/Chen ratio test with residual resampling.

    target_logprobs [K+1, V] (p, filtered like plain sampling), draft_logprobs [K, V] (q, the
    distributions the drafts were drawn from), drafts [K]. Draft i is accepted when u_i < p_i(d_i) /
    q_i(d_i); on the first rejection the emitted token is drawn from normalize(max(p_i - q_i, 0)) (p_i
    when that has no mass); after K acceptances the bonus token is drawn from p_K.
    """
    k = drafts.shape[0]
    p = mx.exp(target_logprobs[:k])
    q = mx.exp(draft_logprobs)
    index = drafts[:, None].astype(mx.int32)
    p_draft = mx.take_along_axis(p, index, axis=-1)[:, 0]
    q_draft = mx.take_along_axis(q, index, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,), key=keys.next())
    accepted = u * q_draft < p_draft
    residual = mx.maximum(p - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    residual = mx.where(mass > 0, residual, p)
    resampled = mx.random.categorical(mx.log(residual), axis=-1, key=keys.next())  # [K]
    bonus = mx.random.categorical(target_logprobs[k:], axis=-1, key=keys.next())  # [1]
    return Verdict(accepted=accepted, replacement=mx.concatenate([resampled, bonus]))


def accepted_prefix(accepted: list[bool], decided: list[bool] | None = None) -> tuple[int, bool]:
    """(number of leading accepted drafts, whether the row after them is decided).

    A row that is not decided ends the accepted run even if its argmax matches the draft.
    """
    n = 0
    for i, ok in enumerate(accepted):
        if decided is not None and not decided[i]:
            return n, False
        if not ok:
            break
        n += 1
    return n, decided is None or decided[n]
