"""A speculative round's pieces, for one sequence or a batch of them: propose (``draft``: the head's drafts),
score (``build_verify``: one verify call on every member's rows), decide (``decide``: penalties, grammar,
acceptance test, logprobs, in that order, lazily) and commit (``commit``: after the one host sync, the tokens
emitted up to the request's end, the head's speculative entries dropped, the grammar rolled back, the
pending token moved; it says how many verify rows the backbone caches keep).

A round at depth K, for one sequence:
  1. draft: the rows waiting for the head go in in one call, its last row gives draft 1; each further draft
     feeds the head its own output (speculative head entries, dropped in ``commit``);
  2. verify: one backbone call on [pending_token, d1..dK] (K+1 rows), GatedDeltaNet layers recording their
     per-row state, MoE routing locked to decode's; with async draft evaluation the drafts are computed
     while the verify graph is built;
  3. decide on device (greedy: argmax match; sampling: Leviathan/Chen ratio test), read back with ONE host
     sync;
  4. emit the accepted tokens one by one, stopping exactly at EOS, a stop string or max_tokens;
  5. roll back to the last token emitted (inside an accepted run where the request ended there): attention
     KV trimmed, GatedDeltaNet state committed at it, head cache trimmed to its verified entries; the
     verified hiddens of the kept rows wait for the head.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .forward import Forward
from .output import LogprobRows
from .replay import ReplayError
from .sampling import Verdict, accepted_prefix
from .sequence import SequenceState


@dataclass
class Drafts:
    """A sequence's drafts for one round (lazy device arrays)."""

    k: int
    tokens: mx.array  # [k] uint32
    logprobs: list[mx.array]  # sampling: the distributions [1, V] the drafts were drawn from
    masks: list[mx.array]  # under a grammar: the mask each draft was chosen under
    catch_up: bool  # the round first fed the head a plain stretch (not a typical round's time)
    timed_from: float | None = None  # a catch-up timed apart: when it was done (the round's typical part)


@dataclass
class Decision:
    """A sequence's verdict on its verify rows; ``accepted`` and ``emitted`` are filled in by ``commit``."""

    drafts: Drafts
    verdict: Verdict
    lp_drafts: LogprobRows | None = None
    lp_replacements: LogprobRows | None = None
    accepted: int = 0
    emitted: list[int] = field(default_factory=list)

    def arrays(self) -> list[mx.array]:
        """What the round's one host sync evaluates for this sequence."""
        verdict = self.verdict
        out = [self.drafts.tokens, verdict.accepted, verdict.replacement]
        if verdict.decided is not None:
            out.append(verdict.decided)
        for rows in (self.lp_replacements, self.lp_drafts):
            if rows is not None:
                out += rows.arrays()
        return out


def draft(seq: SequenceState, k: int, time_after_catch_up: bool = False, *, ahead: int = 0) -> Drafts:
    """1. ``seq``'s k drafts. k = 0: none (a member decoding plainly inside a batched round).

    ``time_after_catch_up``: when the head first takes in a plain stretch, that is computed before the drafts
    (one extra sync) and ``timed_from`` marks the end of it, so the round is timed like any other (the probes
    after plain stretches: untimed, a depth's cost stayed whatever its last rounds measured, however long
    ago). ``ahead``: built before the round before it was decided (``engine.ahead``), which will have added
    this many tokens to the output: nothing is evaluated (its drafts compute with its verify call)."""
    seq.drafting()
    if k == 0:
        return Drafts(0, mx.zeros((0,), dtype=mx.uint32), [], [], False)
    head, choice = seq.head, seq.choice
    catch_up = head.waiting > k + 1  # a round that first catches the head up on a plain stretch
    out = head.flush()
    assert out is not None
    timed_from = None
    if catch_up and time_after_catch_up and not ahead:
        mx.eval(out, head.cache.state)
        timed_from = time.perf_counter()
    out = out[:, -1:]
    tokens: list[mx.array] = []
    logprobs: list[mx.array] = []
    masks: list[mx.array] = []  # under a grammar: row i's allowed tokens (after pending, d1..di)
    history = choice.history
    for i in range(k):
        if i > 0:
            out = head.next_draft(tokens[-1], out)
        token, lp, mask, history = choice.draft(seq.model.logits(out)[:, -1], history)
        tokens.append(token)
        if lp is not None:
            logprobs.append(lp)
        if mask is not None:
            masks.append(mask)
    draft_tokens = mx.concatenate(tokens)
    replay = seq.engine.replay
    if replay is not None:  # a benchmark's known continuation (engine/replay.py): the head ran, its tokens go
        if not choice.params.greedy or choice.matcher is not None:
            raise ReplayError("a replayed continuation drafts for greedy, unconstrained requests only")
        position = len(seq.output.tokens) + ahead
        draft_tokens = mx.array(replay.drafts(seq.request.prompt_tokens, position, k), dtype=mx.uint32)
    if ahead:
        pass  # evaluated with its verify call, once the round before is decided
    elif seq.engine.config.async_draft_eval:
        mx.async_eval(draft_tokens, *logprobs)
    else:
        mx.eval(draft_tokens, *logprobs)
    return Drafts(k, draft_tokens, logprobs, masks, catch_up, timed_from)


def decide(seq: SequenceState, drafts: Drafts, logits: mx.array) -> Decision:
    """2-3. The verdict on ``seq``'s verify rows ``logits`` [k+1, V] (lazy: read back with the caller's one
    host sync)."""
    verdict, lp_drafts, lp_replacements = seq.choice.verdict(logits, drafts.tokens, drafts.logprobs,
                                                             drafts.masks, seq.tie_margin)
    return Decision(drafts, verdict, lp_drafts, lp_replacements)


def commit(seq: SequenceState, decision: Decision, hidden: mx.array) -> int:
    """4-5. Host side, after the sync: the accepted drafts and the token after them go to the output one by
    one, stopping exactly where the request ends, and ``seq`` is rolled to the last token added (head cache,
    grammar, pending token, penalty history, stats); ``hidden`` [1, k+1, H] are its verify rows. Returns how
    many verify rows its backbone caches keep: one per token added, so a run that ends inside an accepted run
    keeps exactly its reply (the prefix cache stores it) and never a draft past its finish."""
    tokens, decided, last = settle(seq, decision)
    advance(seq, decision, hidden, tokens, decided, last)
    return len(tokens)


def settle(seq: SequenceState, decision: Decision) -> tuple[list[int], bool, int | None]:
    """4. The host's half of ``commit``: the verdict read, its tokens added to the output (up to where the
    request ends), the round's stats; the sequence's device state (head, pending token, grammar) untouched
    (``advance``). Returns the tokens added, whether the token after the accepted drafts was decided (not left
    to a plain step by a near tie), and that token (None: not decided)."""
    k, verdict = decision.drafts.k, decision.verdict
    proposed = decision.drafts.tokens.tolist()
    accepted, decided = accepted_prefix(
        verdict.accepted.tolist(), verdict.decided.tolist() if verdict.decided is not None else None
    )
    recorder = seq.stats.recorder
    if decided:
        tokens = proposed[:accepted] + [verdict.replacement.tolist()[accepted]]
    else:
        tokens = proposed[:accepted]  # the token after hinges on a near tie: a plain step decodes it
        recorder.near_tie_fallbacks += 1
    decision.accepted = accepted
    if k > 0:
        recorder.round(k, accepted)
    last = tokens[-1] if decided else None
    tokens = tokens[: emit(seq, decision, tokens)]  # (fewer where the output ended inside the run)
    decision.emitted = tokens
    return tokens, decided, last


def advance(seq: SequenceState, decision: Decision, hidden: mx.array, tokens: list[int] | mx.array,
            decided: bool, last: int | None = None) -> None:
    """5. The sequence's device state after its round kept ``tokens`` (host values, or the lazy tokens of a
    round assumed accepted whole: ``engine.ahead``): the head's speculative entries dropped and the kept rows
    waiting for it, the grammar rolled back (``last``: the token it consumes after the accepted drafts), the
    pending token moved."""
    k = decision.drafts.k
    kept = len(tokens) if isinstance(tokens, list) else tokens.shape[0]
    if k > 0:
        seq.head.drop(k - 1)
    seq.choice.rolled_back(k - decision.accepted if isinstance(tokens, list) else 0, last)
    emitted = None
    if kept:
        emitted = mx.array(tokens, dtype=mx.uint32) if isinstance(tokens, list) else tokens
        seq.head.wait(hidden[:, :kept], emitted)  # row i is followed by tokens[i]
    seq.decided(emitted, near_tie=not decided)


def emit(seq: SequenceState, decision: Decision, tokens: list[int]) -> int:
    """Add ``tokens`` to ``seq``'s output one by one, stopping exactly where the request ends; returns how many
    were added."""
    lp_drafts, lp_replacements = decision.lp_drafts, decision.lp_replacements
    draft_values = lp_drafts.chosen.tolist() if lp_drafts is not None else None
    added = 0
    for i, token in enumerate(tokens):
        # Row i's distribution; an accepted draft's value from the draft gather, the last token's (correction
        # or bonus) from the replacement gather.
        entry = seq.entry(lp_replacements, i, token, draft_values if i < decision.accepted else None)
        seq.output.add(token, entry)
        added += 1
        if seq.output.finish is not None:
            break
    return added


@dataclass
class VerifyCall:
    """A round's verify call built (lazy): its hiddens [B, K+1, H] and each sequence's decision."""

    k: int
    hidden: mx.array
    decisions: list[Decision]

    def arrays(self) -> list[mx.array]:
        return [self.hidden, *[a for decision in self.decisions for a in decision.arrays()]]


def build_verify(seqs: Sequence[SequenceState], drafts: Sequence[Drafts], forward: Forward, cache: list[Any],
                 logits_of: Callable[[mx.array], mx.array], *, lazy: bool = False) -> VerifyCall:
    """2-3. ONE verify call on rows [B, K+1] (the pending token, the drafts, then the pending token again up to
    the deepest sequence's K: never kept), ``logits_of`` its hiddens ([B, K+1, V]), each sequence's ``decide``
    on its own rows: built, not evaluated (``lazy``: none of it started as it is built, ``engine.ahead``)."""
    k = max(d.k for d in drafts)
    lines = []
    for seq, d in zip(seqs, drafts, strict=True):
        assert seq.pending_token is not None
        pending = seq.pending_token.reshape(1)
        lines.append(mx.concatenate([pending, d.tokens, mx.repeat(pending, k - d.k)] if d.k < k else [pending, d.tokens]))
    rows = lines[0][None] if len(lines) == 1 else mx.stack(lines)
    hidden = forward.hidden(rows, cache, verify=True, lazy=True) if lazy else forward.hidden(rows, cache, verify=True)
    logits = logits_of(hidden)
    decisions = [decide(seq, d, logits[b, : d.k + 1]) for b, (seq, d) in enumerate(zip(seqs, drafts, strict=True))]
    return VerifyCall(k, hidden, decisions)
