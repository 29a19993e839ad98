"""Statistics of one generation: what users see as ``native_mtp`` in the CLI and API, and what a sequence
counts while it decodes (``SequenceStats``)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class NativeMTPStats(BaseModel):
    """Native-MTP statistics of one generation (the ``native_mtp`` object of responses)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool
    reason: str | None = None  # why MTP is off, or why it ran at K = 0
    mode: Literal["single_node", "pipeline", "tensor"] = "single_node"  # how the model is split over nodes
    stages: int = 1  # pipeline stages (or tensor group members) the model ran on
    k: int = 0  # the last depth used (the forced one when fixed)
    k_fixed: bool = False
    k_histogram: dict[int, int] = Field(default_factory=dict)  # rounds (plain steps at K = 0) per depth
    rounds: int = 0  # speculative rounds (K >= 1)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    per_position_acceptance: list[float] = Field(default_factory=list)  # P(accept at i | reached i)
    per_position_drafted: list[int] = Field(default_factory=list)  # rounds that tested position i
    near_tie_fallbacks: int = 0  # greedy rounds cut short at a near tie (that position decoded plainly)
    ttft_ms: float = 0.0
    decode_tokens_per_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (engine/prefix_cache.py)
    # The instance's prefix cache after this request (bytes and counters per tier; None: no prefix cache).
    prefix_cache: dict[str, int] | None = None
    # beta(K), delta(K) used by adaptive depth, the device, the stages they were measured through and one
    # plain step's time (ms)
    costs: dict[str, list[float] | str | int | float | None] | None = None
    profile_ms: dict[str, float] | None = None  # time per round phase, with EXO_ENGINE_PROFILE=1
    # Tokens this request decoded in a batch, per batch size (empty: it ran alone).
    batch_sizes: dict[int, int] = Field(default_factory=dict)
    # MLX's memory in the process that ran the request, at its end (``engine.memory.figures``): active_bytes,
    # cache_bytes (freed buffers kept for reuse), peak_bytes (the most active since the process started).
    device_memory: dict[str, int] | None = None


class StatsRecorder:
    """Accumulates counts during a generation and produces ``NativeMTPStats``."""

    def __init__(self, max_k: int):
        self.k_histogram: dict[int, int] = {}
        self.reached = [0] * max_k
        self.accepted = [0] * max_k
        self.rounds = 0
        self.drafted = 0
        self.accepted_total = 0
        self.last_k = 0
        self.near_tie_fallbacks = 0

    def plain_steps(self, n: int) -> None:
        if n:
            self.k_histogram[0] = self.k_histogram.get(0, 0) + n
            self.last_k = 0

    def round(self, k: int, accepted: int) -> None:
        self.k_histogram[k] = self.k_histogram.get(k, 0) + 1
        self.rounds += 1
        self.drafted += k
        self.accepted_total += accepted
        self.last_k = k
        for i in range(k):
            if i >= len(self.reached) or i > accepted:
                break
            self.reached[i] += 1
            if i < accepted:
                self.accepted[i] += 1

    def per_position(self) -> list[float]:
        return [a / r for a, r in zip(self.accepted, self.per_position_drafted(), strict=False)]

    def per_position_drafted(self) -> list[int]:
        return [r for r in self.reached if r > 0]


class SequenceStats:
    """What one sequence counts while it decodes, for its final ``NativeMTPStats``: rounds and acceptance
    (``recorder``), the tokens it decoded in batches of several (per batch size: a batch of one is no batch),
    the times of its start and first token, and with ``profile`` its rounds' time per phase."""

    def __init__(self, max_k: int, profile: bool) -> None:
        self.recorder = StatsRecorder(max(max_k, 1))
        self.batch_sizes: dict[int, int] = {}
        self.batch_rounds = 0  # speculative rounds it drafted in, in a batch of several
        self.started = self.first_time = 0.0
        self._pending_size = 0  # the size of the batch step that computed the pending token
        self.phases: dict[str, float] | None = {} if profile else None
        self._phase_start = self._round_end = 0.0

    def in_batch(self, size: int, tokens: int) -> None:
        """``tokens`` were decided in a step of a batch of ``size``."""
        if size > 1:
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + tokens

    def computed_in(self, size: int) -> None:
        """The pending token was computed by a plain step of a batch of ``size`` (counted when emitted)."""
        self._pending_size = size

    def emitted_pending(self) -> None:
        self.in_batch(self._pending_size, 1)
        self.recorder.plain_steps(1)

    def round_ran(self, size: int, drafted: int, tokens: int) -> None:
        """A round of a batch of ``size`` in which this sequence drafted ``drafted`` and decided ``tokens``
        (with no drafts, its share was a plain step's)."""
        self.in_batch(size, tokens)
        if size > 1 and drafted:
            self.batch_rounds += 1
        if not drafted:
            self.recorder.plain_steps(tokens)

    # -- the phase profile (EXO_ENGINE_PROFILE=1) --------------------------------------------------------
    def round_started(self, start: float) -> None:
        """A round starts at ``start``: the time since the round before counts as "between" (the caller's
        share reading the chunks, the loop's own, plain steps)."""
        if self.phases is None:
            return
        if self._round_end:
            self.phases["between"] = self.phases.get("between", 0.0) + start - self._round_end
        self._phase_start = start

    def mark(self, phase: str) -> None:
        """The round's time since the last mark goes to ``phase``."""
        if self.phases is None:
            return
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self._phase_start
        self._phase_start = now

    def round_ended(self) -> None:
        if self.phases is not None:
            self._round_end = time.perf_counter()

    def report(self, *, policy: Any, reason: str | None, tracked: bool, stages: int, mode: str, prompt_tokens: int,
               completion_tokens: int, cached_tokens: int, prefix_cache: dict[str, int] | None,
               ttft_s: float, decode_s: float, device_memory: dict[str, int] | None = None) -> NativeMTPStats:
        """The final ``NativeMTPStats`` (``policy``: the sequence's ``DepthPolicy``, None without MTP;
        ``tracked``: whether its head was fed; ``mode``: how the model is split, ``Forward.mode``)."""
        rec = self.recorder
        costs = None
        if policy is not None and policy.costs.device:
            effective = policy.effective_costs()
            costs = {
                "beta": [round(b, 3) for b in effective.beta],
                "delta": [round(d, 3) for d in effective.delta],
                "device": effective.device,
                "stages": effective.stages,  # what they were measured through (a pipeline: its stages)
                "plain_ms": round(effective.plain_s * 1000.0, 3) if effective.plain_s else None,
            }
        if policy is not None and policy.fixed_k == 0:
            reason = "the MTP depth was forced to 0 (plain decoding)"
        elif reason is None and policy is not None and not tracked:
            reason = (
                "adaptive depth chose plain decoding: on this device a verify call costs too much for "
                "drafts to pay off even at full acceptance"
            )
        elif reason is None and self.batch_sizes and not self.batch_rounds:
            reason = (
                "adaptive depth chose plain decoding for the batch sizes this request decoded in (batched "
                "plain steps were measured to cost less there; see batch_sizes)"
            )
        fixed = policy is not None and policy.fixed_k is not None
        return NativeMTPStats(
            enabled=policy is not None,
            reason=reason,
            mode=mode,
            stages=stages,
            k=policy.fixed_k if fixed else rec.last_k,
            k_fixed=fixed,
            k_histogram=dict(sorted(rec.k_histogram.items())),
            rounds=rec.rounds,
            drafted_tokens=rec.drafted,
            accepted_tokens=rec.accepted_total,
            acceptance_rate=round(rec.accepted_total / rec.drafted, 4) if rec.drafted else 0.0,
            per_position_acceptance=[round(a, 4) for a in rec.per_position()],
            per_position_drafted=rec.per_position_drafted(),
            near_tie_fallbacks=rec.near_tie_fallbacks,
            profile_ms={k: round(v * 1000, 3) for k, v in self.phases.items()} if self.phases else None,
            ttft_ms=round(ttft_s * 1000.0, 3),
            decode_tokens_per_s=(round((completion_tokens - 1) / decode_s, 3)
                                 if completion_tokens > 1 and decode_s > 0 else 0.0),
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            cached_tokens=cached_tokens,
            prefix_cache=prefix_cache,
            costs=costs,
            batch_sizes=dict(sorted(self.batch_sizes.items())),
            device_memory=device_memory,
        )
