"""A drafter that replays a known continuation at a chosen acceptance rate: a benchmark and test tool.

Random-weight checkpoints at real size (``bench/make_random_model.py``) have heads that accept nothing, so
their rounds only ever cost. To measure what a round costs and earns at real size with real acceptance, a
benchmark first decodes each prompt plainly (greedy), then hands that continuation to a ``ReplayDrafter``
installed on the engine (``Engine.replay``; no setting, request field or endpoint reaches it). Each round
still runs the head exactly as it would (its cost is the real one); only the draft tokens it proposes are
replaced: position i of the output is drafted right with probability ``acceptance`` (a draw fixed by the
seed and the position, so every depth and every batch sees the same pattern) and wrong otherwise. Greedy
verification then accepts exactly the right drafts up to the first wrong one, so the engine's first-position
acceptance is ``acceptance`` and a round of depth K yields 1 + a + ... + a^K tokens on average.

Tests use it to put the end of a reply at a known place inside an accepted run (acceptance 1.0: every round
of depth K emits K + 1 tokens), on any CPU.
"""

from __future__ import annotations

import random
from collections.abc import Sequence


class ReplayError(ValueError):
    """A replayed run that cannot be one: sampling (its acceptance test needs the head's distribution) or
    a grammar (its state follows the head's drafts)."""


class ReplayDrafter:
    """``continuations``: per prompt (its token ids), the greedy output to replay; ``acceptance``: the chance
    that a position is drafted right (0..1); ``seed``: which positions those are."""

    def __init__(self, continuations: dict[tuple[int, ...], Sequence[int]], acceptance: float, vocab_size: int,
                 seed: int = 0) -> None:
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance is a rate in [0, 1], got {acceptance}")
        self.continuations = {tuple(p): list(c) for p, c in continuations.items()}
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self.seed = seed

    def warm_prompt(self) -> tuple[list[int], list[int]]:
        """A prompt to warm the depth policy's acceptance on (the first one) and its continuation."""
        prompt, continuation = next(iter(self.continuations.items()))
        return list(prompt), continuation

    def right(self, position: int) -> bool:
        """Whether output position ``position`` is drafted right (fixed by the seed and the position)."""
        if self.acceptance >= 1.0:
            return True
        return random.Random(self.seed * 1_000_003 + position).random() < self.acceptance

    def drafts(self, prompt: Sequence[int], start: int, k: int) -> list[int]:
        """The k drafts for output positions start..start+k-1 of ``prompt``'s reply: each the continuation's
        token where ``right``, another token where not (and past the continuation's end)."""
        continuation = self.continuations.get(tuple(prompt))
        if continuation is None:
            raise ReplayError("no continuation to replay for this prompt")
        out = []
        for position in range(start, start + k):
            token = continuation[position] if position < len(continuation) else 0
            if position >= len(continuation) or not self.right(position):
                token = (token + 1) % self.vocab_size  # any other token: greedy verification rejects it
            out.append(token)
        return out
