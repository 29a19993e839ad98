"""What a batch does at each step: which waiting generations it admits, which prompt chunks it prefills,
and whether its running members decode. A plain object over plain figures (no MLX, no engine), so every
rule is a row of a table (tests/runner/test_scheduler.py); ``runner.device`` carries its plans out.

A step of a batch is: the chunks of its newcomers' prompts (each on the newcomer's own caches, as its solo
prefill computes them), then a decode step (or speculative round) of every running member, evaluated on the
device one after the other without a host sync between them. A newcomer whose prompt is all in emits its
first token and joins the batch; a member that ends leaves it. There is no prefill phase and no decode
phase: each step carries both, under a budget of prompt tokens (vLLM's v1 scheduler is the model).

The rules, per step (``Scheduler.plan``):

- Prefill budget: while members decode, the step's chunks hold at most ``step_tokens`` prompt tokens in all,
  so a running stream waits at most one chunk's worth of prefill per token (``EngineConfig.batch_prefill_chunk``
  by default); with no member decoding, nobody waits and the budget is ``idle_tokens`` (the solo
  ``prefill_chunk``). Newcomers already prefilling go first (the oldest first), then those admitted now.
- Admission, from the head of the queue, in order: a generation of this batch's model is admitted while
  the batch has room (``max_batch`` counts members and newcomers), the KV of every member, newcomer and it
  fits (``fits``: ``engine.batch.batch_fits`` over their horizons, prompt + max_tokens) and the step's budget has
  a token left for its first chunk. The first that cannot be admitted holds the queue (``StepPlan.held`` says
  why): nothing behind it overtakes it (FIFO). A job that is no generation of this model (a load, another
  model's generation) stops admissions until the batch has drained, then runs.
- Several newcomers may be admitted in one step (as many as the budget takes), and their chunks run in that
  step: 32 short prompts arriving at once all prefill in the first step of an idle batch.

The plan names jobs by a key of the caller's (``runner.device`` uses the jobs themselves). The caller tells
the scheduler what happened: ``begun`` (an admitted newcomer's prompt tokens left to prefill, after a prefix
cache restored the rest; or ``left`` when it ended there), ``fed`` (a chunk ran: the tokens it fed, which may
be fewer than planned), ``joined`` (its first token is out: it decodes from the next step)
and ``left`` (a member or newcomer ended).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Literal

Held = Literal["max_batch", "kv_budget", "step_tokens", "drain"]


@dataclass(frozen=True)
class Waiting:
    """A job at the head of the queue as the scheduler weighs it."""

    key: Hashable
    joins: bool  # a generation of this batch's model (a load or another model's generation waits for a drain)
    horizon: int = 0  # prompt + max_tokens: the KV rows it may hold (0: it will be rejected when it begins)
    prompt: int = 1  # prompt tokens to prefill (a prefix-cache hit, found when it begins, leaves fewer)


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens of a newcomer that this step feeds."""

    key: Hashable
    tokens: int


@dataclass(frozen=True)
class StepPlan:
    """One step: the jobs taken from the queue's head (in order: they begin, then prefill), the prompt chunks
    that run (oldest newcomer first), whether the running members decode, and why the queue's head waits
    (None: nothing waits, or everything waiting was admitted)."""

    admit: tuple[Hashable, ...] = ()
    prefill: tuple[Chunk, ...] = ()
    decode: bool = False
    held: Held | None = None
    budget: int = 0  # the step's prefill budget (what ``prefill`` holds at most)

    @property
    def idle(self) -> bool:
        """Nothing to do: no member, no newcomer, nothing admitted (the batch has drained)."""
        return not (self.admit or self.prefill or self.decode)


@dataclass
class _Newcomer:
    horizon: int
    remaining: int  # prompt tokens still to prefill


class Scheduler:
    """The members and newcomers of one batch, and the plan of its next step.

    ``fits(horizons)``: whether runs with these horizons may decode together (the KV budget; a lone run
    always may). ``step_tokens`` / ``idle_tokens``: the prefill budget of a step with / without members
    decoding."""

    def __init__(self, max_batch: int, fits: Callable[[list[int]], bool], *, step_tokens: int,
                 idle_tokens: int) -> None:
        self.max_batch = max(1, max_batch)
        self.fits = fits
        self.step_tokens = max(1, step_tokens)
        self.idle_tokens = max(1, idle_tokens)
        self.members: dict[Hashable, int] = {}  # key -> horizon, in the order they joined
        self.newcomers: dict[Hashable, _Newcomer] = {}  # in the order they were admitted (FIFO)

    def __len__(self) -> int:
        """Generations of the batch: members and newcomers."""
        return len(self.members) + len(self.newcomers)

    def plan(self, waiting: Iterable[Waiting] = ()) -> StepPlan:
        """The next step, given the queue from its head (``waiting``, in queue order, read lazily: only as far
        as the first job that is not admitted). The admitted jobs are the batch's newcomers from now on: the
        caller begins them (``begun``, or ``left`` when one ends there)."""
        budget = self.step_tokens if self.members else self.idle_tokens
        chunks: list[Chunk] = []
        for key, newcomer in self.newcomers.items():
            take = min(newcomer.remaining, budget)
            if take <= 0:
                break
            chunks.append(Chunk(key, take))
            budget -= take
        admit: list[Hashable] = []
        held: Held | None = None
        horizons = [*self.members.values(), *(n.horizon for n in self.newcomers.values())]
        for job in waiting:
            if not job.joins:
                held = "drain"
                break
            if len(horizons) >= self.max_batch:
                held = "max_batch"
                break
            if job.horizon and not self.fits([h for h in (*horizons, job.horizon) if h]):
                held = "kv_budget"
                break
            if budget <= 0:
                held = "step_tokens"
                break
            take = min(max(1, job.prompt), budget)
            admit.append(job.key)
            chunks.append(Chunk(job.key, take))
            horizons.append(job.horizon)
            budget -= take
            self.newcomers[job.key] = _Newcomer(job.horizon, max(1, job.prompt))
        return StepPlan(tuple(admit), tuple(chunks), bool(self.members), held,
                        self.step_tokens if self.members else self.idle_tokens)

    def begun(self, key: Hashable, remaining: int) -> None:
        """An admitted newcomer began: ``remaining`` prompt tokens are left to prefill (a prefix cache restored
        the others)."""
        self.newcomers[key].remaining = max(1, remaining)

    def fed(self, key: Hashable, tokens: int) -> None:
        """A chunk of ``tokens`` prompt tokens of a newcomer ran."""
        newcomer = self.newcomers[key]
        newcomer.remaining = max(0, newcomer.remaining - tokens)

    def joined(self, key: Hashable) -> None:
        """A newcomer's first token is out: it decodes with the members from the next step."""
        self.members[key] = self.newcomers.pop(key).horizon

    def left(self, key: Hashable) -> None:
        """A member or newcomer ended (finished, cancelled, failed or rejected)."""
        self.members.pop(key, None)
        self.newcomers.pop(key, None)


def shared_call(whole: Iterable[tuple[Hashable, int]], budget: int) -> list[Hashable]:
    """Of the newcomers whose whole prompts a step feeds (``whole``: (key, prompt tokens), oldest first), those
    that prefill as rows of one backbone call (``engine.batch_prefill``): in order, each that keeps the call's
    padded size (rows x the longest prompt) within the step's ``budget``; none unless two or more (one alone
    prefills as it always does)."""
    group: list[Hashable] = []
    longest = 0
    for key, tokens in whole:
        if (len(group) + 1) * max(longest, tokens) <= budget:
            group.append(key)
            longest = max(longest, tokens)
    return group if len(group) > 1 else []
