"""Statistics of one generation: what users see as ``native_mtp`` in the CLI and API."""

from __future__ import annotations

from typing import Literal

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
