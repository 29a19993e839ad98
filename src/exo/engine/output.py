"""A sequence's output: emitted tokens become text, with exact EOS / stop-string / max_tokens handling, and
the log-probabilities reported with them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from .request import FinishReason, GenerationChunk, TokenLogprob, TopLogprob

LOGPROB_FLOOR = -9999.0  # what a token the distribution excludes (-inf) reports


class Output:
    """Emitted tokens -> text. Invariant: nothing is added once ``finish`` is set, and a stop string never
    reaches the text (a possible prefix of one is held back until it cannot be one)."""

    def __init__(self, tokenizer: Any, eos: frozenset[int], stop: Sequence[str], max_tokens: int):
        self.detokenizer = copy.copy(tokenizer.detokenizer)  # shares the token map, not the state
        self.detokenizer.reset()
        self.eos = eos
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.text = ""
        self.sent_chars = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.finish: FinishReason | None = None
        self.stop_sequence: str | None = None  # the stop string that matched (the earliest in the text)

    def add(self, token: int, logprob: TokenLogprob | None = None) -> None:
        self.tokens.append(token)
        if logprob is not None and token not in self.eos:
            self.logprobs.append(logprob)
        if token in self.eos:
            self.finish = "stop"
            self.detokenizer.finalize()
            self.text = self.detokenizer.text
            return
        self.detokenizer.add_token(token)
        if len(self.tokens) >= self.max_tokens:
            self.finish = "length"
            self.detokenizer.finalize()
        previous = len(self.text)
        self.text = self.detokenizer.text
        if self.stop:
            start = max(0, previous - self.hold)
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                at, self.stop_sequence = min(hits, key=lambda hit: hit[0])
                self.text = self.text[:at]
                self.finish = "stop"

    def chunk(self) -> GenerationChunk | None:
        """The text safe to show now (held back: a possible stop-string prefix, a partial character)."""
        end = len(self.text)
        if self.finish is None:
            end = max(self.sent_chars, end - self.hold)
            while end > self.sent_chars and self.text[end - 1] == "\ufffd":
                end -= 1
        new_tokens = self.tokens[self.sent_tokens :]
        if end == self.sent_chars and not new_tokens and self.finish is None:
            return None
        text = self.text[self.sent_chars : end]
        logprobs = self.logprobs[self.sent_logprobs :]
        self.sent_chars, self.sent_tokens, self.sent_logprobs = end, len(self.tokens), len(self.logprobs)
        return GenerationChunk(
            text=text,
            token_ids=new_tokens,
            finish_reason=self.finish,
            logprobs=logprobs or None,
            stop_sequence=self.stop_sequence if self.finish == "stop" else None,
        )


class LogprobRows:
    """Lazy device arrays for the log-probabilities of some rows: the chosen tokens' and the top ones."""

    def __init__(self, logprobs: mx.array, chosen: mx.array, top: int) -> None:
        """logprobs [N, V] (the rows' distributions), chosen [N] (a token per row)."""
        self.chosen = mx.take_along_axis(logprobs, chosen.reshape(-1, 1).astype(mx.int32), axis=-1)[:, 0]
        self.top_ids: mx.array | None = None
        self.top_values: mx.array | None = None
        if top > 0:
            self.top_ids = mx.argpartition(-logprobs, kth=top - 1, axis=-1)[:, :top]
            self.top_values = mx.take_along_axis(logprobs, self.top_ids, axis=-1)

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.chosen, self.top_ids, self.top_values) if a is not None]

    def entry(self, row: int, token: int, token_bytes: Callable[[int], bytes],
              chosen: list[float] | None = None) -> TokenLogprob:
        """Host side, once evaluated: row ``row`` as the entry of ``token`` (``chosen``: the chosen values
        already read back)."""
        value = (chosen if chosen is not None else self.chosen.tolist())[row]
        top: tuple[TopLogprob, ...] = ()
        if self.top_ids is not None and self.top_values is not None:
            pairs = sorted(zip(self.top_ids[row].tolist(), self.top_values[row].tolist(), strict=True), key=lambda p: -p[1])
            top = tuple(TopLogprob(t, token_bytes(t), max(v, LOGPROB_FLOOR)) for t, v in pairs)
        return TokenLogprob(token, token_bytes(token), max(value, LOGPROB_FLOOR), top)
