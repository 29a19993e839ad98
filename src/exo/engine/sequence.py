"""One generation request's decoding state (``SequenceState``): typed parts, each owning its invariant, and
a phase.

- the backbone's caches and the pending token (the last token chosen, not yet fed to the backbone), here;
- the MTP head's rows (``head_rows.HeadRows``);
- how it picks tokens: sampling, penalties, grammar, logprobs (``choice.Choice``);
- its output (``output.Output``: tokens, text, finish);
- its stats and phase profile (``stats.SequenceStats``);
- its use of the prefix cache (``prefix``: the ``PrefillPlan`` its prefill follows and its reply is stored
  through, ``prefix_cache.store_reply``).

The one decode loop (``engine.batch.BatchDecoder``: a batch of one for a solo request, of several, a
pipeline's leader's) drives it through its methods and a round's pieces (``engine.round``).
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .adaptive import DepthPolicy
from .choice import Choice
from .head_rows import HeadRows
from .memory import figures as memory_figures
from .memory import out_of_memory
from .output import LogprobRows, Output
from .prefix_cache import NoPlan, PrefillPlan
from .request import GenerationChunk, GenerationRequest, TokenLogprob
from .stats import SequenceStats

if TYPE_CHECKING:
    from .generate import Engine

TIE_MARGIN_HALF = 2.0**-5  # ~4 ulps of a bf16 logit
TIE_MARGIN_FP32 = 2.0**-14


class Phase(enum.Enum):
    """Where a sequence is in its life; a step boundary is EMITTED or PLAIN_NEXT."""

    NEW = "new"  # nothing in the caches yet
    RESTORED = "restored"  # a prefix cache put the prompt's first ``prefilled`` positions in the caches
    PREFILLING = "prefilling"  # ``prefill`` is feeding the prompt
    FIRST = "first"  # the prompt is in, the first token chosen (lazily): not read back, not emitted
    COMPUTED = "computed"  # a plain step computed the pending token: not read back, not emitted
    EMITTED = "emitted"  # the pending token is the output's last token
    PLAIN_NEXT = "plain_next"  # EMITTED, and a near tie left the next position to a plain step


AT_BOUNDARY = (Phase.EMITTED, Phase.PLAIN_NEXT)


class SequenceState:
    """One request's decoding state. Its own fields (``cache``, ``pending_token``, ``phase``, ``prefilled``)
    change only through its methods; its parts own theirs.

    Invariants, between steps of an unfinished sequence after its first token (``check_invariants``):
    1. the caches hold every position before the pending token: positions == prompt + output tokens, less
       one at a step boundary (the pending token is then the output's last token);
    2. the head covers those positions (``HeadRows``: entries + waiting rows + skipped rows);
    3. the penalty history is the output plus the pending token when that is not emitted yet (``Choice``);
    4. accepted drafts never exceed drafted ones.

    The prompt enters the caches through ONE path, ``prefill`` (chunked, the first token chosen; ``first_token``
    emits it; ``begin`` is both); a prefix cache calls ``restore`` before it, and ``prefill`` then feeds only
    the rest of the prompt. ``prefill_with`` is the same path for a whole prompt that went through the backbone
    with other sequences' (``engine.batch_prefill``): each chunk's aftermath is ``_fed`` for both."""

    def __init__(self, engine: Engine, request: GenerationRequest, policy: DepthPolicy | None, reason: str | None):
        self.engine = engine
        self.model = engine.model
        self.forward = engine.forward
        self.request = request
        self.policy = policy  # None: no MTP for this request (``reason`` says why)
        self.reason = reason
        self.cache = self.forward.new_cache()  # its own; [] once a batch of several holds them (``hand_caches``)
        self.phase = Phase.NEW
        self.pending_token: mx.array | None = None  # [1] uint32
        # Its next round, built while the last one computed (engine.ahead.RoundAhead; its batch sets it): the
        # caches hold that round built, ``check_invariants`` reads the state after the last one
        self.ahead: Any = None
        self._pending_lp: LogprobRows | None = None  # its logprob rows until it is emitted (FIRST, COMPUTED)
        self.prefilled = 0  # prompt positions ``restore`` put in the caches
        # The head is fed only when MTP can run and could pay off (on a compute-bound CPU it never can).
        self.head = HeadRows(engine.loaded.head if policy is not None else None, self.model.embed,
                             policy is not None and policy.mtp_can_pay_off)
        self.choice = Choice(request.sampling, request.constraint, request.max_tokens, request.logprobs)
        eos = frozenset() if request.ignore_eos else engine.loaded.eos_token_ids
        self.output = Output(engine.loaded.tokenizer, eos, request.stop, request.max_tokens)
        profile = engine.config.profile_rounds or os.environ.get("EXO_ENGINE_PROFILE") == "1"
        self.stats = SequenceStats(policy.max_k if policy is not None else 0, profile)
        self.prefix: PrefillPlan | NoPlan = NoPlan()

    @property
    def batchable(self) -> bool:
        """Whether a batch can carry this run: every run can (grammars and logprobs included; a pipelined
        model batches as one node does)."""
        return True

    @property
    def adaptive(self) -> bool:
        """Its depth follows the engine's depth policy (not forced, MTP on)."""
        return self.policy is not None and self.policy.fixed_k is None

    @property
    def near_tie(self) -> bool:
        """A near tie left the next position to a plain step (cleared by the next step or round)."""
        return self.phase is Phase.PLAIN_NEXT

    @property
    def pending_emitted(self) -> bool:
        """The pending token is in the output (or there is none yet)."""
        return self.phase not in (Phase.FIRST, Phase.COMPUTED)

    # -- the prompt ------------------------------------------------------------------------------------
    def restore(self, tokens: int, cache: list[Any], head_cache: KVCache | None = None,
                head_row: mx.array | None = None) -> None:
        """Before ``prefill``: take backbone caches holding this prompt's first ``tokens`` positions (a prefix
        cache's copy; at least the last prompt token is left to prefill, for the first token's logits).
        ``head_cache``: the head's entries for positions 0..tokens-2, ``head_row``: the hidden [1, 1, H] of
        position tokens-1; without them the head starts with a gap (drafts land less at first; the output is
        the same)."""
        prompt = self.request.prompt_tokens
        if not 0 < tokens < len(prompt):
            raise ValueError(f"a restored prefix holds 1..{len(prompt) - 1} of the prompt's tokens, got {tokens}")
        if self.phase is not Phase.NEW:
            raise RuntimeError("restore() comes before prefill(), once")
        self.cache = cache
        self.prefilled = tokens
        self.phase = Phase.RESTORED
        self.head.restore(tokens, head_cache, head_row, prompt[tokens])

    def prefill(self, chunk: int | None = None) -> Generator[int, int | None, None]:
        """THE entry of a prompt into the sequence's caches: ``prompt[prefilled:]`` through the backbone in
        chunks of ``chunk`` tokens (None: ``EngineConfig.prefill_chunk``), each chunk's rows with a known next
        token priming the head. Yields the positions in the caches after each chunk but the last (a batch
        decodes steps there; ``send(n)`` instead of ``next`` makes the next chunk ``n`` tokens: the device's
        scheduler sizes each step's chunks); ends with the first token chosen (lazily), which ``first_token``
        emits. A chunk that is not the last is scheduled on the device (``async_eval``), not waited for: what
        runs after it (a batch's step, another newcomer's chunk) is built while it computes."""
        if self.phase not in (Phase.NEW, Phase.RESTORED):
            raise RuntimeError("a sequence is prefilled once")
        self.phase = Phase.PREFILLING
        self.stats.started = time.perf_counter()
        prompt = mx.array(list(self.request.prompt_tokens), dtype=mx.uint32)
        n = prompt.shape[0]
        chunk = max(1, chunk or self.engine.config.prefill_chunk)
        start = self.prefilled
        scheduled: list[Any] = []  # the last chunk's states in flight: at most two chunks' work is outstanding
        while start < n:
            _, end = next(self.prefix.spans(start, n, chunk))
            self.prefix.arm(self.cache, start, end)  # a prefix cache's snapshot edges inside it are kept as it runs
            # a typed error (the node serves on), also where the forward evaluates layers as it builds them
            with out_of_memory(f"prefilling a prompt of {n} tokens"):
                self._fed(prompt, start, end, self.forward.hidden(prompt[None, start:end], self.cache))
                if end < n:
                    states = [[c.state for c in self.cache], self.head.cache.state]
                    mx.async_eval(states)
                    mx.eval(scheduled)  # the chunk before (this one keeps computing): a long prompt's memory stays bounded
            if end < n:
                scheduled = states
                chunk = max(1, (yield end) or chunk)
            start = end

    def _fed(self, prompt: mx.array, start: int, end: int, hidden: mx.array) -> None:
        """After a chunk ``prompt[start:end]`` went through the backbone (``hidden`` [1, T, H]): a snapshot where
        the prefix cache keeps one, its rows with a known next token to the head, and at the prompt's end the
        first token chosen (lazily: ``Phase.FIRST``)."""
        n = prompt.shape[0]
        self.prefix.reached(end, self.cache, hidden, start)
        known = min(end, n - 1) - start  # rows whose next token is known prime the head now
        if known > 0:
            self.head.wait(hidden[:, :known], prompt[start + 1 : start + 1 + known])
            self.head.flush()
        if end == n:
            token, lp = self.choice.choose(self.model.logits(hidden[:, -1:])[:, -1])
            self.head.wait(hidden[:, -1:], token)
            self.pending_token, self._pending_lp = token, lp
            self.choice.chosen(token)
            self.phase = Phase.FIRST

    def whole_prompt_in(self, tokens: int) -> bool:
        """Whether the prompt can enter the caches in one chunk of at most ``tokens`` tokens from position 0
        (nothing restored or fed yet, no prefix-cache snapshot edge inside it): what ``prefill_with`` takes."""
        n = len(self.request.prompt_tokens)
        return self.phase is Phase.NEW and n <= tokens and not self.prefix.inside(0, n)

    def prefill_with(self, cache: list[Any], hidden: mx.array, started: float | None = None) -> None:
        """``prefill`` done by a backbone call shared with other sequences (``engine.batch_prefill``): ``cache``
        holds the whole prompt (it becomes this sequence's caches), ``hidden`` [1, n, H] is its rows, ``started``
        when that call began. The rest is ``prefill``'s own (snapshots, the head, the first token chosen);
        ``first_token`` follows."""
        if not self.whole_prompt_in(len(self.request.prompt_tokens)):
            raise RuntimeError("prefill_with() takes a whole prompt, from position 0, once")
        self.phase = Phase.PREFILLING
        self.stats.started = started or time.perf_counter()
        self.cache = cache
        prompt = mx.array(list(self.request.prompt_tokens), dtype=mx.uint32)
        self._fed(prompt, 0, prompt.shape[0], hidden)

    def first_token(self, store: bool = True) -> Iterator[GenerationChunk]:
        """After ``prefill``: read back and emit the first token (its chunks); the sequence is then at a step
        boundary. Then (``store``) ``store_prompt``; a caller that emits the chunks itself passes False and calls
        ``store_prompt`` once they are out, before any step (the store's copies are no part of the first
        token's time)."""
        if self.phase is not Phase.FIRST:
            raise RuntimeError("first_token() comes after a whole prefill()")
        first, lp = self.pending_token, self._pending_lp
        assert first is not None
        self._pending_lp = None
        self.phase = Phase.EMITTED  # added to the output below, before anything else runs
        with out_of_memory(f"prefilling a prompt of {len(self.request.prompt_tokens)} tokens"):  # its last chunk
            mx.eval(first, *(lp.arrays() if lp is not None else ()))
        self.stats.first_time = time.perf_counter()
        token = first.item()
        self.output.add(token, self.entry(lp, 0, token))
        self.stats.recorder.plain_steps(0)
        yield from self.drain()
        if store:
            self.store_prompt()

    def store_prompt(self) -> None:
        """The prompt's blocks and snapshots into the prefix cache (engine/prefix_cache.py), after the first
        token and before any decode step moves the caches on (a store that fails is skipped, never raised)."""
        self.prefix.capture(self.cache, self.head.cache if self.head.tracked else None)

    def begin(self, chunk: int | None = None) -> Iterator[GenerationChunk]:
        """``prefill`` whole, then ``first_token``."""
        for _ in self.prefill(chunk):
            pass
        yield from self.first_token()

    # -- steps (engine/batch.py, engine/round.py) ------------------------------------------------------
    def check_joinable(self) -> None:
        """A sequence joins a batch at a step boundary: started and unfinished."""
        if self.output.finish is not None or self.phase not in AT_BOUNDARY:
            raise ValueError("only a started, unfinished sequence at a step boundary can join a batch")

    def hand_caches(self) -> list[Any]:
        """Hand this sequence's backbone caches to a batch's rows: its head state stays here."""
        cache, self.cache = self.cache, []
        return cache

    def computed(self, token: mx.array, batch_size: int, lp_rows: LogprobRows | None = None) -> None:
        """A plain step fed the pending token (emitted) and computed ``token``, the new pending one
        (``lp_rows``: its logprobs, evaluated with the step; ``batch_size``: the step's, for the stats)."""
        assert self.phase in AT_BOUNDARY
        self.pending_token, self._pending_lp = token, lp_rows
        self.phase = Phase.COMPUTED
        self.choice.chosen(token)
        self.stats.computed_in(batch_size)

    def emit_pending(self, token: int) -> Iterator[GenerationChunk]:
        """Emit the pending token a plain step computed (``token``: its value); yields the chunks it makes
        showable."""
        assert self.phase is Phase.COMPUTED
        self.stats.emitted_pending()
        lp, self._pending_lp = self._pending_lp, None
        self.output.add(token, self.entry(lp, 0, token))
        self.phase = Phase.EMITTED
        yield from self.drain()

    def drafting(self) -> None:
        """A round starts (its drafts are being built): a near tie's plain step is spent on it."""
        assert self.phase in AT_BOUNDARY
        self.phase = Phase.EMITTED

    def decided(self, tokens: mx.array | None, near_tie: bool) -> None:
        """A round's commit: ``tokens`` [n] went to the output (None: none did), the last one is the pending
        token; ``near_tie``: the next position is left to a plain step."""
        if tokens is not None:
            self.pending_token = tokens[-1:]
            self.choice.decided(tokens)
        self.phase = Phase.PLAIN_NEXT if near_tie else Phase.EMITTED

    def entry(self, rows: LogprobRows | None, row: int, token: int, chosen: list[float] | None = None) -> TokenLogprob | None:
        """Host side: row ``row`` of evaluated logprob ``rows`` as the entry of ``token`` (None: no logprobs)."""
        return rows.entry(row, token, self.engine.token_bytes, chosen) if rows is not None else None

    def tie_margin(self, dtype: mx.Dtype) -> float:
        """The relative top-2 gap under which a greedy verify row is left to a plain step
        (``EngineConfig.greedy_tie_margin``)."""
        margin = self.engine.config.greedy_tie_margin
        if margin is not None:
            return margin
        if self.engine.verify_mode.exact:
            return 0.0
        return TIE_MARGIN_FP32 if dtype == mx.float32 else TIE_MARGIN_HALF

    # -- the end -----------------------------------------------------------------------------------------
    def cancelled(self) -> bool:
        stop = self.request.should_stop
        if stop is not None and stop():
            self.output.finish = "cancelled"
            return True
        return False

    def drain(self) -> Iterator[GenerationChunk]:
        """Yield what can be shown so far; once finished, everything left goes in the final chunk."""
        if self.output.finish is None:
            chunk = self.output.chunk()
            if chunk is not None:
                yield chunk

    def final_chunk(self) -> GenerationChunk:
        """The last chunk (the run has finished): what is left of the output, the finish reason, stats."""
        assert self.output.finish is not None
        stats = self.stats.report(
            policy=self.policy, reason=self.reason, tracked=self.head.tracked, stages=self.forward.stages,
            mode=self.forward.mode,
            prompt_tokens=len(self.request.prompt_tokens), completion_tokens=len(self.output.tokens),
            cached_tokens=self.prefilled,
            prefix_cache=self.engine.prefix_cache.figures() if self.engine.prefix_cache is not None else None,
            ttft_s=self.stats.first_time - self.stats.started, decode_s=time.perf_counter() - self.stats.first_time,
            device_memory=memory_figures(),
        )
        final = self.output.chunk() or GenerationChunk("", [], self.output.finish)
        final.finish_reason = self.output.finish
        final.stats = stats
        return final

    def release(self) -> None:
        """The request is over: its backbone caches are dropped wherever the layers are (``forward.end``: a
        pipeline's stages drop its slot; this process's die with the sequence), once. A sequence whose caches
        a batch holds has none of its own left (``hand_caches``)."""
        cache, self.cache = self.cache, []
        self.forward.end(cache)

    def check_invariants(self, positions: int | None = None) -> None:
        """Assert the invariants (class docstring) of a started, unfinished sequence at a step boundary;
        ``positions``: the caches' positions when a batch holds them (its row's), else read here."""
        if self.pending_token is None or self.output.finish is not None:
            return
        if self.ahead is not None:
            with self.ahead.as_after_round(self.cache):
                self._check_invariants(positions)
        else:
            self._check_invariants(positions)

    def _check_invariants(self, positions: int | None) -> None:
        if positions is None:
            positions = next((c.offset for c in self.cache if isinstance(c, KVCache)), None)
        emitted = len(self.output.tokens)
        expected = len(self.request.prompt_tokens) + emitted - (1 if self.pending_emitted else 0)
        assert positions is None or positions == expected, f"caches hold {positions} positions, expected {expected}"
        if self.pending_emitted:
            assert self.output.tokens[-1] == int(self.pending_token.item()), "the pending token is not the last emitted"
        self.head.check(expected)
        if self.choice.processors:
            history = self.choice.history.shape[0]
            assert history == emitted + (0 if self.pending_emitted else 1), "history out of step"
        assert self.stats.recorder.accepted_total <= self.stats.recorder.drafted
