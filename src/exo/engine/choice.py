"""How one sequence picks its tokens, in the one order every path takes (the first token, a plain step, a
round's drafts and its verdict): penalties over its history, its grammar's mask, sampling with its own key
stream (a seed reproduces its samples whatever else decodes with it), its log-probabilities."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from .constraints import Grammar, Matcher
from .output import LogprobRows
from .sampling import (
    KeyStream,
    SamplingParams,
    Verdict,
    apply_processors,
    filtered_logprobs,
    greedy_verdict,
    make_processors,
    sampling_verdict,
    select_token,
)


class Choice:
    """A sequence's sampling parameters and key stream, penalty history, grammar and logprob request.

    Invariants: ``history`` is the output plus the pending token while that is not emitted (kept only where
    there are penalties); the grammar has consumed every decided token but ``unread``, a plain step's choice
    that it consumes when its value is next needed (reading it waits for that step: off the token path
    otherwise)."""

    def __init__(self, params: SamplingParams, constraint: Grammar | None, max_tokens: int,
                 top_logprobs: int | None) -> None:
        self.params = params
        self.keys = KeyStream(params.seed)
        self.processors = make_processors(params)
        self.history = mx.zeros((0,), dtype=mx.uint32)  # the completion so far, for penalties
        self.matcher: Matcher | None = constraint.matcher(max_tokens) if constraint is not None else None
        self.top_logprobs = top_logprobs
        self.unread: mx.array | None = None

    @property
    def bare_greedy(self) -> bool:
        """The choice is the row's argmax: no penalties, grammar or logprobs to apply."""
        return self.params.greedy and not self.processors and self.matcher is None and self.top_logprobs is None

    # -- a plain choice ------------------------------------------------------------------------------
    def choose(self, logits: mx.array) -> tuple[mx.array, LogprobRows | None]:
        """A plain step's token (lazily) from its logits [1, V]: penalties, the grammar's mask, a sample with
        this sequence's keys, its logprob rows."""
        if self.processors:
            logits = apply_processors(self.processors, self.history, logits)
        mask = self._mask_after(logits)
        if mask is not None:
            logits = mx.where(mask, logits, -mx.inf)
        token, logprobs = self.sample(logits)
        return token, self._logprob_rows(logprobs, logits, token)

    def sample(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        token, logprobs = select_token(logits, self.params, self.keys)
        return token.astype(mx.uint32), logprobs

    def chosen(self, token: mx.array) -> None:
        """``token`` [1], a plain choice, is the sequence's pending token: the history takes it now, the grammar
        when its value is next needed."""
        if self.processors:
            self.history = mx.concatenate([self.history, token])
        self.unread = token

    # -- a round ---------------------------------------------------------------------------------------
    def draft(self, logits: mx.array, history: mx.array) -> tuple[mx.array, mx.array | None, mx.array | None, mx.array]:
        """One draft from the head's logits [1, V] given ``history`` (the completion and the drafts before
        it): (the draft [1] uint32, the distribution it was drawn from when sampling, the grammar's mask it was
        chosen under, the history with it). The grammar consumes it speculatively (``rolled_back`` undoes)."""
        if self.processors:
            logits = apply_processors(self.processors, history, logits)
        mask = self._mask_after(logits)  # the grammar after the accepted prefix and the drafts before
        if mask is not None:
            logits = mx.where(mask, logits, -mx.inf)
        logprobs = None
        if self.params.greedy:
            draft = mx.argmax(logits, axis=-1)
        else:
            logprobs = filtered_logprobs(logits, self.params)
            draft = mx.random.categorical(logprobs, axis=-1, key=self.keys.next())
        draft = draft.astype(mx.uint32)
        if self.matcher is not None:
            self.matcher.consume(int(draft.item()))
        if self.processors:
            history = mx.concatenate([history, draft])
        return draft, logprobs, mask, history

    def verdict(self, logits: mx.array, drafts: mx.array, draft_logprobs: list[mx.array], masks: list[mx.array],
                tie_margin: Callable[[mx.Dtype], float]) -> tuple[Verdict, LogprobRows | None, LogprobRows | None]:
        """The verdict on verify rows ``logits`` [k+1, V] of ``drafts`` [k] (lazy): each row penalised with
        the drafts before it, masked by the grammar after them, then the acceptance test; with no drafts,
        row 0 chosen as a plain step chooses (the same key use: a seed reproduces plain sampling). Returns
        (the verdict, the drafts' logprob rows, the emitted tokens' logprob rows)."""
        k = drafts.shape[0]
        if self.processors:
            logits = mx.concatenate([
                apply_processors(self.processors, mx.concatenate([self.history, drafts[:i]]), logits[i : i + 1])
                for i in range(k + 1)
            ])
        if self.matcher is not None:
            # Row i sees the grammar after the drafts before it: the masks the drafts were chosen under, and
            # for the last row the state after every draft (computed while the verify call runs).
            mx.async_eval(logits)
            self.read_unread()
            logits = mx.where(mx.stack([*masks, self.matcher.mask()]), logits, -mx.inf)
        target_logprobs = None
        if k == 0:
            token, target_logprobs = self.sample(logits)
            verdict = Verdict(accepted=mx.zeros((0,), dtype=mx.bool_), replacement=token)
        elif self.params.greedy:
            verdict = greedy_verdict(logits, drafts, tie_margin(logits.dtype))
        else:
            target_logprobs = filtered_logprobs(logits, self.params)
            verdict = sampling_verdict(target_logprobs, mx.concatenate(draft_logprobs), drafts, self.keys)
        if self.top_logprobs is None:
            return verdict, None, None
        distribution = target_logprobs if target_logprobs is not None else _row_logprobs(logits)
        return (verdict, LogprobRows(distribution[:k], drafts, 0),
                LogprobRows(distribution, verdict.replacement, self.top_logprobs))

    def rolled_back(self, rejected: int, last: int | None) -> None:
        """After a round's verdict: the grammar forgets the ``rejected`` drafts and consumes ``last``, the
        token after the accepted ones (None: a near tie left it to a plain step)."""
        if self.matcher is not None:
            self.matcher.rollback(rejected)
            if last is not None:
                self.matcher.consume(last)

    def decided(self, tokens: mx.array) -> None:
        """A round decided ``tokens`` (the last is the pending token): the history takes them; the grammar
        has consumed them (``draft``, ``rolled_back``)."""
        if self.processors:
            self.history = mx.concatenate([self.history, tokens])
        self.unread = None

    # -- the grammar -----------------------------------------------------------------------------------
    def _mask_after(self, logits: mx.array) -> mx.array | None:
        """The grammar's allowed tokens [V] at its current state (None: no grammar), computed on the host
        while the device computes ``logits`` (queued first), so it stays off the token's critical path."""
        if self.matcher is None:
            return None
        mx.async_eval(logits)
        self.read_unread()
        return self.matcher.mask()

    def read_unread(self) -> None:
        """The grammar consumes the plain choice it has not read yet (reading its value)."""
        if self.matcher is not None and self.unread is not None:
            self.matcher.consume(int(self.unread.item()))
            self.unread = None

    def _logprob_rows(self, logprobs: mx.array | None, logits: mx.array, chosen: mx.array) -> LogprobRows | None:
        if self.top_logprobs is None:
            return None
        return LogprobRows(logprobs if logprobs is not None else _row_logprobs(logits), chosen, self.top_logprobs)


def _row_logprobs(logits: mx.array) -> mx.array:
    """The distribution a greedy choice is reported under: the (penalised, masked) logits' softmax."""
    x = logits.astype(mx.float32)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)
