"""Generation: the sequence state and the pieces of plain decoding and native-MTP speculative decoding. The
loop that drives them is ``engine.batch.BatchDecoder``: a solo request (``SequenceState.stream``) is a batch
of one.

State between rounds: the backbone caches hold every position before ``pending_token`` (the last
emitted token, not yet fed to the backbone). The MTP head's cache holds an entry for every position
whose (hidden, next token) pair has been committed; pairs not yet committed wait in ``_head_rows``.

A speculative round at depth K:
  1. draft: commit the waiting rows to the head cache in one call; its last row gives draft 1; each
     further draft feeds the head its own output (speculative head entries, dropped afterwards);
  2. verify: one backbone call on [pending_token, d1..dK] (K+1 rows), GatedDeltaNet layers recording
     their per-row state, MoE routing locked to decode's (``moe_verify``);
  3. decide on device (greedy: argmax match; sampling: Leviathan/Chen ratio test) and read everything
     back with ONE host sync; with async draft evaluation the drafts are computed while the verify graph
     is being built;
  4. emit the accepted tokens one by one, stopping exactly at EOS, a stop string or max_tokens;
  5. roll back to the last token emitted (inside an accepted run where the request ended there): attention
     KV trimmed, GatedDeltaNet state committed at it, head cache trimmed to its verified entries; the
     verified hiddens of the kept rows wait for the head.
K = 0 is plain decoding, pipelined like mlx-lm's generate_step (the next step's graph is built before
the current token is read back): ``BatchDecoder``'s plain step, one row per member.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .adaptive import (
    AcceptanceTracker,
    BatchDepthPolicy,
    DepthCosts,
    DepthPolicy,
    can_pay_off,
    trace_from_env,
)
from .batch_cache import batch_row
from .constraints import ConstraintSpec, Grammar, Matcher, ToolFormat, compile_grammar
from .costs import warmup_costs
from .forward import Forward, LocalForward
from .loader import LoadedModel
from .memory import out_of_memory
from .models.layers import GdnPrefill, MoEVerifyMode
from .prefix_cache import NoPlan, PrefillPlan, PrefixCache, restore_prefix
from .replay import ReplayDrafter, ReplayError
from .sampling import (
    KeyStream,
    SamplingParams,
    Verdict,
    accepted_prefix,
    apply_processors,
    filtered_logprobs,
    greedy_verdict,
    make_processors,
    sampling_verdict,
    select_token,
)
from .stats import NativeMTPStats, StatsRecorder
from .verify import VerifyMode, VerifyRows, probe

log = logging.getLogger(__name__)

NativeMTPMode = Literal["auto", "on", "off"]
TIE_MARGIN_HALF = 2.0**-5  # ~4 ulps of a bf16 logit
TIE_MARGIN_FP32 = 2.0**-14
FinishReason = Literal["stop", "length", "cancelled"]
MAX_FORCED_K = 8
MAX_TOP_LOGPROBS = 20
LOGPROB_FLOOR = -9999.0  # what a token the distribution excludes (-inf) reports
HEAD_FLUSH_ROWS = 256
# Head rows an adaptive run keeps waiting while its policy decodes plainly (K = 0); the rows before them never
# reach the head. A probe first runs the head over the rows waiting since the last one: on a compute-bound
# CPU, 64 rows of exo-demo's head cost ~18 ms, as much as the probe round itself (adaptive at K = 0: 0.954x
# plain decoding). The head's context then has a gap before its last HEAD_WINDOW rows: at 32 its probes
# accepted as many drafts as with the whole stretch (60 of 66 on exo-demo), at 8 fewer (48 of 66), which
# biases the policy against drafting. A batch keeps fewer (batch.BATCH_HEAD_WINDOW).
HEAD_WINDOW = 32
GRAMMAR_CACHE = 16  # compiled grammars an engine keeps


class NativeMTPUnavailableError(RuntimeError):
    """``native_mtp="on"`` was asked for but this model/configuration cannot run it."""


class GenerationRequestError(ValueError):
    """A generation request is invalid (too long for the context, bad max_tokens, bad K...)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthError(GenerationRequestError):
    """The prompt plus the completion budget does not fit in the model's context."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


WARM_QUESTION = "Explain how a rainbow forms, in a few sentences."
WARM_TOKENS = 64  # ~20 rounds at K = 3 of a trained head
WARM_ROUNDS = 24  # and at most this many rounds (a head whose drafts all fail makes a token a round)


@dataclass(frozen=True)
class EngineConfig:
    """How an engine decodes (``verify_mode``: how its verify calls compute their rows)."""

    native_mtp_enabled: bool = True  # the global switch (EXO_NATIVE_MTP_ENABLED / settings)
    moe_verify: MoEVerifyMode = "route_locked"
    # How a verify call computes its rows (engine/verify.py): "auto" measures which parts must run per
    # row on this device (attention, logits) so that each row rounds as its decode step; "per_row" and
    # "batched" force them (tests, benchmarks).
    verify_rows: VerifyRows = "auto"
    async_draft_eval: bool = True
    prefill_chunk: int = 2048
    # Tokens per prefill chunk of a run joining a running batch (runner.device): the batch decodes a step
    # between chunks, so a long prompt holds its streams for a chunk, not for the whole prompt (exo-demo on a
    # 2-core CPU, a 1657-token prompt in one 2048 chunk: 3.8 s without a token for 4 running streams; in
    # chunks of 256: 0.8-1.1 s at most, bench/prefill_stall.py@3c719fd).
    batch_prefill_chunk: int = 256
    # How GatedDeltaNet layers run a prompt chunk (models.layers.GdnPrefill): "auto" takes the chunked form on
    # MLX CUDA only; "chunked" anywhere (tests force it on the CPU); "loop" never. Decode and verify rows never.
    gdn_prefill: GdnPrefill = "auto"
    # Batched steps compute each sequence as its solo step would (models.backbone.set_batch_invariant): every
    # linear row a one-row product, attention per sequence over its own unpadded keys, experts unsorted.
    batch_invariant: bool = False
    # Lanes a batch decodes in (engine.batch.BatchLanes: BatchDecoders on streams of their own, evaluated at
    # once: on MLX's CPU backend, a stream thread each). None: 1 (batch.default_lanes says why).
    batch_lanes: int | None = None
    # Relative top-2 logit gap under which a greedy verify row is re-decoded plainly (sampling.greedy_verdict).
    # None: 0 where the verify probe found every row equal to its decode step (greedy output is then plain
    # decoding's by construction), else a few ulps of the logits' dtype (a safety net, not a guarantee).
    greedy_tie_margin: float | None = None
    # Before its first adaptive request, the engine drafts a short greedy answer of its own at max_k
    # (``Engine.warm_acceptance``): the head's acceptance on the model's text seeds the depth policy.
    warm_acceptance: bool = True
    # Time every speculative round by phase (``NativeMTPStats.profile_ms``; EXO_ENGINE_PROFILE=1 as well).
    profile_rounds: bool = False
    default_k: int = 1  # defaults for a checkpoint without a model card
    max_k: int = 3
    disabled_reason: str = "native MTP is disabled (EXO_NATIVE_MTP_ENABLED=0 or the node's settings)"


@dataclass
class GenerationRequest:
    prompt_tokens: Sequence[int]
    max_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    native_mtp: NativeMTPMode = "auto"
    mtp_k: int | None = None  # force a depth (0..8); None: adaptive
    # Polled once per decode step or speculative round; True ends the generation ("cancelled").
    should_stop: Callable[[], bool] | None = None
    # Tokens must follow this grammar (engine/constraints.py): every position's logits are masked.
    constraint: Grammar | None = None
    # Log-probabilities of the emitted tokens with this many alternatives (0..20); None: none.
    logprobs: int | None = None
    # The prompt ends inside a think block its chat template opened: the output starts with reasoning.
    thinking: bool = False
    # End-of-sequence tokens are ordinary tokens: the generation runs to max_tokens (or a stop string).
    ignore_eos: bool = False
    # OpenAI's prompt_cache_key: the prefix cache keeps (and evicts) the entries of one key together.
    cache_key: str | None = None
    # Polled through the engine's one-time warm-up that the first adaptive request waits on (round costs, the
    # head's warm acceptance); True ends the request before it starts ("cancelled"). None: ``should_stop``.
    stop_warmup: Callable[[], bool] | None = None


@dataclass(frozen=True)
class TopLogprob:
    token: int
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """An emitted token's log-probability under the distribution it was chosen from (after penalties,
    the grammar's mask, and for sampling the filters and temperature), with the most likely alternatives."""

    token: int
    bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass
class GenerationChunk:
    """One streamed piece: new text, the tokens behind it, and on the last chunk the outcome."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stats: NativeMTPStats | None = None
    # With GenerationRequest.logprobs: one entry per token of token_ids, EOS excepted.
    logprobs: list[TokenLogprob] | None = None
    # On the last chunk: the stop string that ended the output (finish_reason "stop"), if one did.
    stop_sequence: str | None = None


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: NativeMTPStats
    logprobs: list[TokenLogprob] | None = None


class Engine:
    """Generates from one loaded model. Not thread-safe: callers serialize requests."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, forward: Forward | None = None):
        """``forward``: how the backbone runs; by default here (``LocalForward``), or through the stages of
        a pipeline (``exo.engine.pipeline.PipelineForward``, on the last stage)."""
        self.loaded = loaded
        self.config = config or EngineConfig()
        self.forward = forward or LocalForward(loaded.model)
        if hasattr(loaded.model, "set_gdn_prefill"):  # the model's layers take this engine's choice
            loaded.model.set_gdn_prefill(self.config.gdn_prefill)
        self._verify: VerifyMode | None = None
        self.verify_probe: dict[str, bool] = {}
        self._costs: DepthCosts | None = None
        self._policy: DepthPolicy | None = None
        self._policy_key: tuple[int, int] | None = None
        self._batch_policy: BatchDepthPolicy | None = None
        self._grammar_tokenizer: Any = None
        self._closing_tokens: Any = None
        self._token_bytes: dict[int, bytes] = {}
        self._grammars: dict[tuple[str, str], Grammar] = {}  # insertion order: least recently used first
        # Set by the runner (exo.runner.prefix_store) or a caller: prompts restore their cached prefixes.
        self.prefix_cache: PrefixCache | None = None
        # Set by a benchmark or a test only (never by a setting or a request): rounds draft a known continuation
        # at a chosen acceptance instead of the head's tokens (engine/replay.py).
        self.replay: ReplayDrafter | None = None
        # Seconds of each phase of the warm-up so far (the verify probe, each round-cost measurement, the warm
        # acceptance): what a first MTP request waits for, printed by the benchmarks.
        self.warmup_seconds: dict[str, float] = {}

    @property
    def model(self) -> Any:
        return self.loaded.model

    @property
    def vocab_size(self) -> int:
        """Rows of the logits (the embedding table; at least the tokenizer's vocabulary)."""
        return int(self.model.text_model.embed_tokens.weight.shape[0])

    @property
    def grammar_tokenizer(self) -> Any:
        """The tokenizer as llguidance sees it (built once, on first need: constraints, token bytes)."""
        if self._grammar_tokenizer is None:
            import llguidance.hf

            hf = getattr(self.loaded.tokenizer, "_tokenizer", self.loaded.tokenizer)
            self._grammar_tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=max(self.vocab_size, len(hf)), eos_token=sorted(self.loaded.eos_token_ids) or None
            )
        return self._grammar_tokenizer

    @property
    def closing_tokens(self) -> Any:
        """The tokenizer's ``ClosingTokens`` (constrained JSON closes as the budget runs out); built once."""
        if self._closing_tokens is None:
            from .closing import ClosingTokens

            self._closing_tokens = ClosingTokens.of(self.grammar_tokenizer, self.vocab_size)
        return self._closing_tokens

    def grammar(self, spec: ConstraintSpec, fmt: ToolFormat) -> Grammar:
        """``spec`` compiled for this model (ConstraintError if it cannot be); the last few are kept, since
        an agent sends the same tools and schemas turn after turn."""
        key = (spec.to_json(), fmt)
        grammar = self._grammars.pop(key, None)
        if grammar is None:
            grammar = compile_grammar(spec, self.grammar_tokenizer, self.vocab_size, fmt, self.closing_tokens)
        self._grammars[key] = grammar
        while len(self._grammars) > GRAMMAR_CACHE:
            self._grammars.pop(next(iter(self._grammars)))
        return grammar

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (a special token: its text)."""
        out = self._token_bytes.get(token)
        if out is None:
            out = self._token_bytes[token] = self.grammar_tokenizer.decode_bytes([token])
        return out

    def set_native_mtp(self, enabled: bool, disabled_reason: str) -> None:
        """The node-wide switch; call between generations (it applies from the next one on)."""
        if (self.config.native_mtp_enabled, self.config.disabled_reason) != (enabled, disabled_reason):
            self.config = dataclasses.replace(self.config, native_mtp_enabled=enabled, disabled_reason=disabled_reason)

    # -- native MTP availability -------------------------------------------------------------------
    def mtp_unavailable_reason(self, mode: NativeMTPMode = "auto") -> str | None:
        if mode == "off":
            return "native MTP was turned off for this request"
        if not self.config.native_mtp_enabled:
            return self.config.disabled_reason
        if self.loaded.head is None:
            return self.loaded.head_status.reason or "this model has no usable MTP head"
        return None

    @property
    def verify_mode(self) -> VerifyMode:
        """How this engine's verify calls compute their rows (probed once, on the first need)."""
        if self._verify is None:
            if self.config.verify_rows == "auto":
                start = time.perf_counter()
                self._verify, self.verify_probe = probe(self.model, self.config.moe_verify)
                self.warmup_seconds["verify probe"] = time.perf_counter() - start
            else:
                self._verify = VerifyMode.forced(self.config.moe_verify, self.config.verify_rows)
            self.forward.verify = self._verify
        return self._verify

    def costs(self) -> DepthCosts:
        """Round costs measured on this machine (once per engine)."""
        costs = self._measured_costs(None)
        assert costs is not None
        return costs

    def _measured_costs(self, stop: Callable[[], bool] | None) -> DepthCosts | None:
        """``costs()``, or None when ``stop`` said to stop before they were measured."""
        if self._costs is None:
            self.verify_mode  # noqa: B018 - the measured verify calls compute their rows as real ones do
            assert self.loaded.head is not None
            self._costs = warmup_costs(self.model, self.forward, self.loaded.head, self.config.max_k, stop,
                                       phases=self.warmup_seconds)
        return self._costs

    def warmup(self) -> None:
        """What the first adaptive request would otherwise pay for: the round costs, the head's acceptance."""
        if self.mtp_unavailable_reason() is None:
            self._adaptive_policy()

    # -- generation --------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        return self.start(request).stream()

    def start(self, request: GenerationRequest) -> SequenceState:
        """A validated run of ``request`` (nothing computed yet): ``stream()`` it alone, or hand it to a
        ``BatchDecoder`` (exo.engine.batch) once ``begin()`` has emitted its first token."""
        self._validate(request)
        reason = self.mtp_unavailable_reason(request.native_mtp)
        if request.native_mtp == "on" and reason is not None:
            raise NativeMTPUnavailableError(f"native MTP cannot run: {reason}")
        policy = None
        if reason is None:
            self.verify_mode  # noqa: B018 - probed before the first verify call
        if reason is None and request.mtp_k is not None:
            fixed = request.mtp_k
            policy = DepthPolicy(costs=self._costs_or_unmeasured(fixed), max_k=max(fixed, 1), fixed_k=fixed)
        elif reason is None:
            # The first adaptive request waits on the engine's warm-up (round costs, the head's acceptance):
            # its cancellation and deadline are polled through it, and end the request before it starts.
            policy = self._warmed_policy(request.stop_warmup or request.should_stop)
            if policy is None:
                run = SequenceState(self, request, None, reason)
                run.output.finish = "cancelled"
                return run
            policy.new_request()
        run = SequenceState(self, request, policy, reason)
        restore_prefix(self.prefix_cache, run)  # a cached prefix of the prompt: only the rest is prefilled
        return run

    def _adaptive_policy(self) -> DepthPolicy:
        """One adaptive policy per engine: what it learns (acceptance, round costs) carries over."""
        policy = self._warmed_policy(None)
        assert policy is not None
        return policy

    def _warmed_policy(self, stop: Callable[[], bool] | None) -> DepthPolicy | None:
        """``_adaptive_policy()``, its warm-up polling ``stop`` (None: stopped before the warm-up was done;
        nothing of an interrupted warm acceptance is kept, so the next request warms up again)."""
        costs = self._measured_costs(stop)
        if costs is None:
            return None
        key = (self.config.max_k, self.config.default_k)
        if self._policy is None or self._policy_key != key:
            policy = DepthPolicy(costs=costs, max_k=self.config.max_k, default_k=self.config.default_k,
                                 trace=trace_from_env(costs, self.config.max_k))
            if self.config.warm_acceptance and can_pay_off(costs, self.config.max_k):
                start = time.perf_counter()
                warm = self.warm_acceptance(stop)
                self.warmup_seconds["warm acceptance"] = time.perf_counter() - start
                if warm is None:
                    return None
                policy.tracker.absorb(warm)
                if policy.trace is not None:
                    policy.trace({"event": "warm_acceptance", "rates": warm.rates(), "rounds": warm.reached[0]})
            elif stop is not None and stop():  # stopped while the costs were measured (kept: they are whole)
                return None
            self._policy, self._policy_key = policy, key
        return self._policy

    def warm_acceptance(self, stop: Callable[[], bool] | None = None) -> AcceptanceTracker | None:
        """The head's acceptance on the model's own greedy answer to a short fixed question
        (``WARM_QUESTION``, ``WARM_TOKENS``, at most ``WARM_ROUNDS`` rounds), every round at max_k: before any request, the depth policy's
        first choices rest on this rather than on the prior alone (which held a head landing 90% of its
        drafts at 0.7 through the first requests on an H200, and sent them to K = 0). ``stop``: polled every
        round; None when it stopped the warm-up."""
        if stop is not None and stop():
            return None
        stopped = False

        def should_stop() -> bool:
            nonlocal stopped
            stopped = stopped or (stop is not None and stop())
            return stopped or fixed.rounds_run >= WARM_ROUNDS

        k = self.config.max_k
        tokenizer = self.loaded.tokenizer
        messages = [{"role": "user", "content": WARM_QUESTION}]
        try:
            prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        except Exception:  # noqa: BLE001 - a tokenizer without a chat template
            prompt = list(tokenizer.encode(WARM_QUESTION))
        fixed = DepthPolicy(costs=self._costs_or_unmeasured(k), max_k=k, fixed_k=k)
        request = GenerationRequest(prompt, max_tokens=WARM_TOKENS, sampling=SamplingParams(temperature=0.0),
                                    native_mtp="on", ignore_eos=True, should_stop=should_stop)
        for _ in SequenceState(self, request, fixed, None).stream():
            pass
        return None if stopped else fixed.tracker

    def batch_policy(self) -> BatchDepthPolicy:
        """The depth of batched rounds per batch size (exo.engine.batch), over the engine's adaptive policy."""
        solo = self._adaptive_policy()
        if self._batch_policy is None or self._batch_policy.solo is not solo:
            self._batch_policy = BatchDepthPolicy(solo)
        return self._batch_policy

    def complete(self, request: GenerationRequest) -> GenerationResult:
        text, tokens, finish, stats = [], [], None, None
        logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        for chunk in self.generate(request):
            text.append(chunk.text)
            tokens.extend(chunk.token_ids)
            finish, stats = chunk.finish_reason or finish, chunk.stats or stats
            if logprobs is not None and chunk.logprobs:
                logprobs.extend(chunk.logprobs)
        assert finish is not None and stats is not None
        return GenerationResult("".join(text), tokens, finish, stats, logprobs)

    def _costs_or_unmeasured(self, k: int) -> DepthCosts:
        if self._costs is not None and self._costs.max_k >= k:
            return self._costs
        # A forced depth needs no cost model; report none rather than measuring.
        return DepthCosts(beta=(0.0,) * max(k, 1), delta=(0.0,) * max(k, 1), device="")

    def _validate(self, request: GenerationRequest) -> None:
        if not request.prompt_tokens:
            raise GenerationRequestError("the prompt is empty")
        if request.max_tokens < 1:
            raise GenerationRequestError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if request.mtp_k is not None and not 0 <= request.mtp_k <= MAX_FORCED_K:
            raise GenerationRequestError(f"the MTP depth must be in 0..{MAX_FORCED_K}, got {request.mtp_k}")
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_TOP_LOGPROBS:
            raise GenerationRequestError(f"top logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {request.logprobs}")
        vocab = self.model.text_model.embed_tokens.weight.shape[0]
        if any(not 0 <= t < vocab for t in request.prompt_tokens):
            raise GenerationRequestError(f"prompt token ids must be in [0, {vocab})")
        limit = self.loaded.context_length
        if limit is not None and len(request.prompt_tokens) + request.max_tokens > limit:
            raise ContextLengthError(
                f"the prompt ({len(request.prompt_tokens)} tokens) plus max_tokens ({request.max_tokens}) "
                f"exceeds the model's context of {limit} tokens"
            )


class _Output:
    """Emitted tokens -> text, with exact EOS / stop-string / max_tokens handling."""

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


class _LogprobRows:
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


@dataclass
class _Drafts:
    """A run's drafts for one round (lazy device arrays)."""

    k: int
    tokens: mx.array  # [k] uint32
    logprobs: list[mx.array]  # sampling: the distributions [1, V] the drafts were drawn from
    masks: list[mx.array]  # under a grammar: the mask each draft was chosen under
    catch_up: bool  # the round first fed the head a plain stretch (not a typical round's time)
    timed_from: float | None = None  # a solo catch-up round: when the catch-up was done (its typical part)


@dataclass
class _Decision:
    """A run's verdict on its verify rows; ``accepted`` and ``emitted`` are filled in after the sync."""

    drafts: _Drafts
    verdict: Verdict
    lp_drafts: _LogprobRows | None = None
    lp_replacements: _LogprobRows | None = None
    accepted: int = 0
    emitted: list[int] = field(default_factory=list)

    def arrays(self) -> list[mx.array]:
        """What the round's one host sync evaluates for this run."""
        verdict = self.verdict
        out = [self.drafts.tokens, verdict.accepted, verdict.replacement]
        if verdict.decided is not None:
            out.append(verdict.decided)
        for rows in (self.lp_replacements, self.lp_drafts):
            if rows is not None:
                out += rows.arrays()
        return out


class SequenceState:
    """One generation request's decoding state: the one object the decode loop (engine/batch.py: a batch of
    one for a solo request, of several, a pipeline's leader's) drives. Its fields change only through its own
    methods.

    Fields: ``cache`` (the backbone's caches: its own while it decodes alone; [] once a batch of several holds
    them), ``pending_token`` (the last
    token chosen, [1] uint32), ``pending_emitted`` (whether it is in ``output`` yet), the head state
    (``head_cache``; ``_head_hidden``/``_head_tokens``, the (hidden, next token) rows waiting for the head;
    ``head_skipped``, rows dropped unseen), ``output`` (tokens, text, finish), ``history`` (the completion
    for penalties), ``matcher`` (the grammar), ``recorder`` (acceptance stats) and ``prefilled`` (prompt
    positions ``restore`` put in the caches).

    Invariants, between steps of an unfinished sequence after its first token (``check_invariants`` asserts
    them):
    1. the caches hold every position before the pending token: positions == prompt + output tokens, less
       one while the pending token is emitted (it is then the output's last token);
    2. the head cache plus the waiting rows plus the skipped rows cover those positions (entry p pairs
       hidden[p] with token[p + 1]; every cached position's next token is known);
    3. ``history`` is the output plus the pending token when that is not emitted yet;
    4. accepted drafts never exceed drafted ones.

    The prompt enters the caches in ONE place, ``prefill`` (chunked, the first token chosen; ``first_token``
    emits it; ``begin`` is both); a prefix cache calls ``restore`` before it, and ``prefill`` then feeds only
    the rest of the prompt.
    A round's pieces: ``draft`` (propose), the caller's verify call (score), ``decide`` (penalties, grammar
    mask, acceptance test or sampling, logprobs, in that order) and ``commit`` (the tokens emitted up to the
    request's end, head cache trimmed, grammar, pending token; returns the verify rows the caller's backbone
    caches keep: one per token emitted)."""

    def __init__(self, engine: Engine, request: GenerationRequest, policy: DepthPolicy | None, reason: str | None):
        self.engine = engine
        self.model = engine.model
        self.head = engine.loaded.head if policy is not None else None
        self.request = request
        self.params = request.sampling
        self.policy = policy
        self.reason = reason
        self.keys = KeyStream(self.params.seed)
        self.processors = make_processors(self.params)
        self.forward = engine.forward
        self.cache = self.forward.new_cache()
        self.head_cache = KVCache()
        # The head is fed only when MTP can run and could pay off (on a compute-bound CPU it never can).
        self.track_head = policy is not None and policy.mtp_can_pay_off
        self._head_hidden: list[mx.array] = []
        self._head_tokens: list[mx.array] = []
        self.head_skipped = 0  # waiting rows dropped before the head saw them (its context has a gap there)
        self.prefilled = 0  # prompt positions already in the caches before ``prefill`` (``restore``)
        self.pending_token: mx.array | None = None
        self._plain_next = False  # a near tie left the next position to plain decoding
        profile = engine.config.profile_rounds or os.environ.get("EXO_ENGINE_PROFILE") == "1"
        self._phases: dict[str, float] | None = {} if profile else None
        self._phase_start = self._round_end = 0.0
        self.history = mx.zeros((0,), dtype=mx.uint32)  # the completion so far, for penalties
        eos = frozenset() if request.ignore_eos else engine.loaded.eos_token_ids
        self.output = _Output(engine.loaded.tokenizer, eos, request.stop, request.max_tokens)
        # Constrained decoding: the grammar's state follows the emitted tokens (and, within a round, the
        # drafts); ``_pending_consumed`` says whether it has consumed ``pending_token`` yet.
        self.matcher: Matcher | None = None
        if request.constraint is not None:
            self.matcher = request.constraint.matcher(request.max_tokens)
        self._pending_consumed = True
        self.top_logprobs = request.logprobs
        max_k = policy.max_k if policy is not None else 0
        self.recorder = StatsRecorder(max(max_k, 1))
        # Batching (exo.engine.batch): tokens it decoded in a batch of several, per batch size; speculative rounds
        # it ran in one; whether ``pending_token`` was added to the output yet.
        self.batch_sizes: dict[int, int] = {}
        self.batch_rounds = 0
        self.pending_emitted = True
        self._pending_batch = 0  # the size of the batch step that computed ``pending_token``
        self._pending_lp: _LogprobRows | None = None  # its logprobs (a batched plain step's), until emitted
        self.started = self.first_time = 0.0
        self._first: tuple[mx.array, _LogprobRows | None] | None = None
        self._prefix: PrefillPlan | NoPlan = NoPlan()

    @property
    def batchable(self) -> bool:
        """Whether a batch (exo.engine.batch: batched plain steps and batched MTP rounds) can carry this run:
        every run can (grammars and logprobs included: ``choose`` and ``decide`` apply them per sequence). A
        pipelined model batches as one node does: its forward mirrors the batch's cache operations on every
        stage."""
        return True

    @property
    def near_tie(self) -> bool:
        """A near tie left the next position to a plain step (cleared by the next step or round)."""
        return self._plain_next

    # -- what a batch does to a member (engine/batch.py) ---------------------------------------------
    def check_joinable(self) -> None:
        """A sequence joins a batch at a step boundary: started, unfinished, its pending token emitted."""
        if self.output.finish is not None or self.pending_token is None or not self.pending_emitted:
            raise ValueError("only a started, unfinished sequence at a step boundary can join a batch")

    def hand_caches(self) -> list[Any]:
        """Hand this sequence's backbone caches to a batch's (a batch of one steps on them where they are; a
        second member makes them a batch's row): its head state stays here."""
        cache, self.cache = self.cache, []
        return cache

    def stop_head(self) -> None:
        """Measured rounds showed drafting cannot pay off here: the head is fed no more."""
        self.track_head = False
        self._head_hidden, self._head_tokens = [], []

    def flush_head_async(self) -> None:
        """Long plain stretches of a lone sequence: its head cache kept current in batches, off the token path."""
        out = self._flush_head()
        mx.async_eval(out, self.head_cache.state)

    def computed(self, token: mx.array, batch_size: int, lp_rows: _LogprobRows | None = None) -> None:
        """A batched plain step fed the pending token (emitted) and computed ``token``, the new pending one
        (``lp_rows``: its logprobs, evaluated with the step; ``batch_size``: the batch's size for the stats, 0
        for a lone sequence). The grammar consumes it when its value is read (``_consume_pending``: the next
        step's mask, or a round's drafts)."""
        assert self.pending_emitted
        self._plain_next = False
        self.pending_token = token
        self.pending_emitted = False
        self._pending_consumed = False
        self._pending_lp = lp_rows
        self._pending_batch = batch_size
        if self.processors:
            self.history = mx.concatenate([self.history, token])

    def emit_pending(self, token: int) -> Iterator[GenerationChunk]:
        """Emit the pending token a batched plain step computed (``token``: its value), counted by the size
        of that step; yields the chunks it makes showable."""
        assert not self.pending_emitted
        if self._pending_batch:
            self.batch_sizes[self._pending_batch] = self.batch_sizes.get(self._pending_batch, 0) + 1
        self.recorder.plain_steps(1)
        lp, self._pending_lp = self._pending_lp, None
        self.output.add(token, self._logprob_entry(lp, 0, token))
        self.pending_emitted = True
        yield from self.drain()

    def keep_head_window(self, rows: int) -> None:
        """Only the last ``rows`` waiting head rows stay (a plain stretch the head need not take in)."""
        if len(self._head_hidden) > rows:
            dropped = self._head_hidden[:-rows] if rows else self._head_hidden
            self.head_skipped += sum(h.shape[1] for h in dropped)
            del self._head_hidden[: len(dropped)], self._head_tokens[: len(dropped)]

    def observe_batched_round(self, decision: _Decision) -> None:
        """A batched round's verdict on this sequence's drafts, for its depth policy's acceptance."""
        if decision.drafts.k:
            self.batch_rounds += 1
            assert self.policy is not None
            self.policy.tracker.observe(decision.drafts.k, decision.accepted)

    def counted_in_batch(self, size: int, tokens: int, decision: _Decision) -> None:
        """Stats of a batched round's share: ``tokens`` emitted at batch ``size`` (a run that drafted nothing
        in it made plain steps)."""
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + tokens
        if not decision.drafts.k:
            self.recorder.plain_steps(tokens)

    @property
    def head_rows_waiting(self) -> int:
        return sum(h.shape[1] for h in self._head_hidden)

    # -- invariants and the prefix cache's seam --------------------------------------------------------
    def restore(self, tokens: int, cache: list[Any], head_cache: KVCache | None = None,
                head_row: mx.array | None = None) -> None:
        """Before ``prefill``: take backbone caches holding this prompt's first ``tokens`` positions (a prefix
        cache's copy; at least the last prompt token is left to prefill, for the first token's logits).
        ``head_cache``: the head's entries for positions 0..tokens-2, ``head_row``: the hidden [1, 1, H] of
        position tokens-1 (it waits for its next token, the prompt's own); without them the head starts
        with a gap (drafts land less at first; the output is the same)."""
        prompt = self.request.prompt_tokens
        if not 0 < tokens < len(prompt):
            raise ValueError(f"a restored prefix holds 1..{len(prompt) - 1} of the prompt's tokens, got {tokens}")
        if self.pending_token is not None or self.prefilled:
            raise RuntimeError("restore() comes before prefill(), once")
        self.cache = cache
        self.prefilled = tokens
        if not self.track_head:
            return
        if head_cache is not None and head_row is not None:
            if head_cache.offset != tokens - 1:
                raise ValueError(f"the head cache holds {head_cache.offset} entries, a prefix of {tokens} needs {tokens - 1}")
            self.head_cache = head_cache
            self.wait_for_head(head_row, mx.array([prompt[tokens]], dtype=mx.uint32))
        else:
            self.head_skipped = tokens

    def store_end(self, cache: list[Any] | None = None, batch: tuple[list[Any], int] | None = None) -> int:
        """A sequence that ended normally (finish "stop" or "length"; never a cancelled or failed one) keeps
        its generated part in the prefix cache (``PrefillPlan.capture_end``): the next turn resends this
        prompt and the reply. ``cache``: its caches where a batch holds them (its row: ``batch_cache.batch_row``);
        ``batch``: (the batch's caches, its row) instead, which a pipeline's other stages need to find their
        part; None: its own. On a pipeline every other stage stores its layers' part too (``forward.store_end``:
        the tokens past the prompt, before the row is filtered out or the slot dropped). The head's entries go
        too where it was fed every position (no gap), its waiting rows but the last taken in first. Returns the
        bytes stored here (0: nothing, e.g. a reply shorter than a block, or a store that raised: logged and
        counted, ``PrefixCache.note_failure``; the request's reply is never affected)."""
        if self.output.finish not in ("stop", "length"):
            return 0
        if batch is not None:
            cache = batch_row(*batch)
        caches = self.cache if cache is None else cache
        positions = next((c.offset for c in caches if isinstance(c, KVCache)), None)
        fed = [*self.request.prompt_tokens, *self.output.tokens]
        # The caches hold the prompt, then the output's tokens in order, the last one never fed; past a finish
        # inside an accepted run they hold drafts after it too: then the state at the end is not this reply's.
        if positions is None or positions > len(fed):
            return 0
        prompt = getattr(self._prefix, "n", None)  # (None: no plan, nothing to store on any stage)
        if (self.forward.stages > 1 and prompt is not None and hasattr(self.forward, "store_end")
                and positions - prompt >= self._prefix.cache.block and not self._prefix.failed):
            owner, row = batch if batch is not None else (self.cache, -1)
            self.forward.store_end(owner, row, fed[prompt:positions])
        head = None
        waiting = self.head_rows_waiting
        if self.track_head and self.head_skipped == 0 and waiting and self.head_cache.offset + waiting == positions:
            hidden = mx.concatenate(self._head_hidden, axis=1)
            tokens = mx.concatenate(self._head_tokens)
            if waiting > 1:
                assert self.head is not None
                self.head(self.model.embed(tokens[None, :-1]), hidden[:, :-1], self.head_cache)
            self._head_hidden, self._head_tokens = [hidden[:, -1:]], [tokens[-1:]]
            head = (self.head_cache, hidden[:, -1:])
        return self._prefix.capture_end(fed[:positions], caches, head)

    def check_invariants(self, positions: int | None = None) -> None:
        """Assert the invariants (class docstring) of a started, unfinished sequence at a step boundary;
        ``positions``: the caches' positions when a batch holds them (its row's), else read here."""
        if self.pending_token is None or self.output.finish is not None:
            return
        if positions is None:
            positions = next((c.offset for c in self.cache if isinstance(c, KVCache)), None)
        emitted = len(self.output.tokens)
        expected = len(self.request.prompt_tokens) + emitted - (1 if self.pending_emitted else 0)
        assert positions is None or positions == expected, f"caches hold {positions} positions, expected {expected}"
        if self.pending_emitted:
            assert self.output.tokens[-1] == int(self.pending_token.item()), "the pending token is not the last emitted"
        if self.track_head:
            waiting = self.head_rows_waiting
            assert waiting == sum(t.shape[0] for t in self._head_tokens)
            covered = self.head_cache.offset + waiting + self.head_skipped
            assert covered == expected, f"the head covers {covered} positions, the caches {expected}"
        if self.processors:
            assert self.history.shape[0] == emitted + (0 if self.pending_emitted else 1), "history out of step"
        assert self.recorder.accepted_total <= self.recorder.drafted

    def tie_margin(self, dtype: mx.Dtype) -> float:
        margin = self.engine.config.greedy_tie_margin
        if margin is not None:
            return margin
        if self.engine.verify_mode.exact:
            return 0.0
        return TIE_MARGIN_FP32 if dtype == mx.float32 else TIE_MARGIN_HALF

    # -- forward pieces ----------------------------------------------------------------------------
    def _logits_for(self, hidden_row: mx.array, history: mx.array) -> mx.array:
        logits = self.model.logits(hidden_row)[:, -1]
        if self.processors:
            logits = apply_processors(self.processors, history, logits)
        return logits

    def _grammar_mask(self, logits: mx.array) -> mx.array | None:
        """The grammar's allowed tokens [V] at its current state (None: no grammar). Computed on the host
        while the device computes ``logits`` (queued first), so it stays off the token's critical path."""
        if self.matcher is None:
            return None
        mx.async_eval(logits)
        self._consume_pending()
        return self.matcher.mask()

    def _masked(self, logits: mx.array) -> mx.array:
        mask = self._grammar_mask(logits)
        return logits if mask is None else mx.where(mask, logits, -mx.inf)

    def _consume_pending(self) -> None:
        if self.matcher is not None and not self._pending_consumed:
            assert self.pending_token is not None
            self.matcher.consume(int(self.pending_token.item()))
            self._pending_consumed = True

    def _row_logprobs(self, logits: mx.array) -> mx.array:
        """The distribution a greedy choice is reported under: the (penalised, masked) logits' softmax."""
        x = logits.astype(mx.float32)
        return x - mx.logsumexp(x, axis=-1, keepdims=True)

    def _logprob_rows(self, logprobs: mx.array | None, logits: mx.array, chosen: mx.array) -> _LogprobRows | None:
        if self.top_logprobs is None:
            return None
        return _LogprobRows(logprobs if logprobs is not None else self._row_logprobs(logits), chosen, self.top_logprobs)

    def _logprob_entry(self, rows: _LogprobRows | None, row: int, token: int, chosen: list[float] | None = None) -> TokenLogprob | None:
        """Host side: row ``row`` of evaluated ``rows`` as the entry of ``token``."""
        if rows is None:
            return None
        engine = self.engine
        value = (chosen if chosen is not None else rows.chosen.tolist())[row]
        top: tuple[TopLogprob, ...] = ()
        if rows.top_ids is not None and rows.top_values is not None:
            pairs = sorted(zip(rows.top_ids[row].tolist(), rows.top_values[row].tolist(), strict=True), key=lambda p: -p[1])
            top = tuple(TopLogprob(t, engine.token_bytes(t), max(v, LOGPROB_FLOOR)) for t, v in pairs)
        return TokenLogprob(token, engine.token_bytes(token), max(value, LOGPROB_FLOOR), top)

    def wait_for_head(self, hidden: mx.array | None, tokens: mx.array) -> None:
        """A plain step's row (``hidden`` [1, 1, H], its next ``tokens``) waits for the head; None: the head
        never sees it (a plain stretch's row before its last window), counted in ``head_skipped``."""
        if not self.track_head:
            return
        if hidden is None:
            self.head_skipped += 1
            return
        self._head_hidden.append(hidden)
        self._head_tokens.append(tokens.reshape(-1))

    def _flush_head(self) -> mx.array | None:
        """Commit the waiting (hidden, next token) rows to the head cache; returns the head output."""
        if not self._head_hidden:
            return None
        hidden = mx.concatenate(self._head_hidden, axis=1)
        tokens = mx.concatenate(self._head_tokens)[None]
        self._head_hidden, self._head_tokens = [], []
        assert self.head is not None
        return self.head(self.model.embed(tokens), hidden, self.head_cache)

    def prefill(self, chunk: int | None = None) -> Iterator[int]:
        """THE entry of a prompt into the sequence's caches: ``prompt[prefilled:]`` (``restore`` may have
        put the rest there) through the backbone in chunks of ``chunk`` tokens (None:
        ``EngineConfig.prefill_chunk``), each chunk's rows with a known next token priming the head. Yields
        the positions in the caches after each chunk but the last (a batch decodes steps there); ends with
        the first token chosen (lazily), which ``first_token`` emits."""
        if self.pending_token is not None or self._first is not None:
            raise RuntimeError("a sequence is prefilled once")
        self.started = time.perf_counter()
        prompt = mx.array(list(self.request.prompt_tokens), dtype=mx.uint32)
        n = prompt.shape[0]
        chunk = max(1, chunk or self.engine.config.prefill_chunk)
        for start, end in self._prefix.spans(self.prefilled, n, chunk):  # edges at the prefix cache's snapshots
            hidden = self.forward.hidden(prompt[None, start:end], self.cache)
            self._prefix.reached(end, self.cache, hidden)
            # Rows whose next token is known prime the head now, chunk by chunk.
            known = min(end, n - 1) - start
            if known > 0:
                self.wait_for_head(hidden[:, :known], prompt[start + 1 : start + 1 + known])
                self._flush_head()
            if end < n:
                with out_of_memory(f"prefilling a prompt of {n} tokens"):  # a typed error; the node serves on
                    mx.eval([c.state for c in self.cache], self.head_cache.state)
                yield end
        self._first = self.choose(self.model.logits(hidden[:, -1:])[:, -1], hidden[:, -1:])

    def sample(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        token, logprobs = select_token(logits, self.params, self.keys)
        return token.astype(mx.uint32), logprobs

    def choose(self, logits: mx.array, hidden: mx.array | None) -> tuple[mx.array, _LogprobRows | None]:
        """Decide a plain step's token (lazily) from its logits [1, V], in the one order every plain step
        of every path takes (the first token, a solo step, a batch member's step): penalties over the history,
        the grammar's mask, sampling with this sequence's keys, the logprobs; its row (``hidden`` [1, 1, H],
        the token) waits for the head."""
        if self.processors:
            logits = apply_processors(self.processors, self.history, logits)
        logits = self._masked(logits)
        token, lp = self.sample(logits)
        self.wait_for_head(hidden, token)
        return token, self._logprob_rows(lp, logits, token)

    # -- the loop ------------------------------------------------------------------------------------
    def stream(self) -> Iterator[GenerationChunk]:
        """The whole generation alone: ``begin``, then a batch of one (``exo.engine.batch.BatchDecoder``: the
        one decode loop, whose lone member steps on its own caches under its own depth policy) until it ends.
        Finished, cancelled, failed or abandoned: its caches are dropped wherever the layers are (a pipeline's
        other stages too). When the loop failed, that error is the one reported: a failure of ``end`` (the
        stages are likely down for the same reason) is logged, never raised in its place."""
        from .batch import BatchDecoder  # the batch drives sequences: it imports this module

        batch = BatchDecoder(self.engine)
        try:
            if self.output.finish is None:  # else stopped during the engine's warm-up (``Engine.start``)
                yield from self.begin()
            if self.output.finish is not None:
                self.release()
                yield self.final_chunk()
                return
            batch.add(self)
            while len(batch):
                for _, chunks in batch.step():
                    yield from chunks
        except Exception:
            try:
                self._drop(batch)
            except Exception:
                log.exception("ending the request on the pipeline failed after the generation failed")
            raise
        except BaseException:  # closed (GeneratorExit) or interrupted: no error of the loop's to keep
            self._drop(batch)
            raise

    def _drop(self, batch: Any) -> None:
        if len(batch):
            batch.drop()
        else:
            self.release()

    def release(self) -> None:
        """The request is over: its backbone caches are dropped wherever the layers are (``forward.end``: a
        pipeline's stages drop its slot; this process's die with the sequence), once. A sequence whose caches
        a batch holds has none of its own left (``hand_caches``)."""
        cache, self.cache = self.cache, []
        self.forward.end(cache)

    def begin(self, chunk: int | None = None) -> Iterator[GenerationChunk]:
        """``prefill`` whole, then ``first_token``: the sequence is then at a step boundary."""
        for _ in self.prefill(chunk):
            pass
        yield from self.first_token()

    def first_token(self) -> Iterator[GenerationChunk]:
        """After ``prefill``: read back and emit the first token (its chunks)."""
        if self._first is None:
            raise RuntimeError("first_token() comes after a whole prefill()")
        first, lp = self._first
        self._first = None
        self.pending_token = first
        self.pending_emitted = True  # added to the output below, before anything else runs
        self._pending_consumed = False
        if self.processors:
            self.history = mx.concatenate([self.history, first])
        with out_of_memory(f"prefilling a prompt of {len(self.request.prompt_tokens)} tokens"):  # its last chunk
            mx.eval(first, *(lp.arrays() if lp is not None else ()))
        self.first_time = time.perf_counter()
        token = first.item()
        self.output.add(token, self._logprob_entry(lp, 0, token))
        self.recorder.plain_steps(0)
        yield from self.drain()
        # The prompt's blocks and snapshots (engine/prefix_cache.py), before any decode step moves the caches on.
        self._prefix.capture(self.cache, self.head_cache if self.track_head else None)

    def final_chunk(self) -> GenerationChunk:
        """The last chunk (the run has finished): what is left of the output, the finish reason, stats."""
        assert self.output.finish is not None
        stats = self._stats(self.first_time - self.started, time.perf_counter() - self.first_time)
        final = self.output.chunk() or GenerationChunk("", [], self.output.finish)
        final.finish_reason = self.output.finish
        final.stats = stats
        return final

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

    def round_started(self, start: float) -> None:
        """A lone round starts at ``start`` (its phase timer, EXO_ENGINE_PROFILE=1): the time since the round
        before counts as "between" (the caller's share reading the chunks, the loop's own, plain steps)."""
        if self._phases is not None and self._round_end:
            self._phases["between"] = self._phases.get("between", 0.0) + start - self._round_end
        self._phase_start = start

    def round_ended(self) -> None:
        self._round_end = time.perf_counter()

    def _mark(self, phase: str) -> None:
        """Accumulates wall time per phase of speculative rounds (EXO_ENGINE_PROFILE=1)."""
        if self._phases is None:
            return
        now = time.perf_counter()
        self._phases[phase] = self._phases.get(phase, 0.0) + now - self._phase_start
        self._phase_start = now

    # -- the pieces of a speculative round (alone, or a member's share of a batched round) -------------
    def draft(self, k: int, time_after_catch_up: bool = False) -> _Drafts:
        """1. Draft k tokens: commit the waiting rows to the head cache (its last row drafts d1), then chain
        the head on its own output (speculative head entries, trimmed in ``_accept``). k = 0: nothing (a
        batch member decoding plainly inside a batched round).

        ``time_after_catch_up``: when the head first takes in a plain stretch, that is computed before the
        drafts (one extra sync) and ``timed_from`` marks the end of it, so the round is timed like any other.
        Such rounds are the probes that follow plain stretches: untimed, a depth's cost stayed whatever its
        last rounds had measured, however long ago."""
        self._plain_next = False
        if k == 0:
            return _Drafts(0, mx.zeros((0,), dtype=mx.uint32), [], [], False)
        assert self.head is not None
        model, params, matcher = self.model, self.params, self.matcher
        # A round that first catches the head up on a plain stretch is not a typical round.
        catch_up = self.head_rows_waiting > k + 1
        out = self._flush_head()
        assert out is not None
        timed_from = None
        if catch_up and time_after_catch_up:
            mx.eval(out, self.head_cache.state)
            timed_from = time.perf_counter()
        out = out[:, -1:]
        drafts: list[mx.array] = []
        draft_logprobs: list[mx.array] = []
        masks: list[mx.array] = []  # under a grammar: row i's allowed tokens (after pending, d1..di)
        history = self.history
        for i in range(k):
            if i > 0:
                out = self.head(model.embed(drafts[-1][None]), out, self.head_cache)
            logits = self._logits_for(out, history)
            mask = self._grammar_mask(logits)  # the grammar after the accepted prefix and drafts 1..i
            if mask is not None:
                masks.append(mask)
                logits = mx.where(mask, logits, -mx.inf)
            if params.greedy:
                draft = mx.argmax(logits, axis=-1)
            else:
                logprobs = filtered_logprobs(logits, params)
                draft = mx.random.categorical(logprobs, axis=-1, key=self.keys.next())
                draft_logprobs.append(logprobs)
            draft = draft.astype(mx.uint32)
            drafts.append(draft)
            if matcher is not None:
                matcher.consume(int(draft.item()))  # speculative: rolled back with the caches below
            if self.processors:
                history = mx.concatenate([history, draft])
        draft_tokens = mx.concatenate(drafts)
        replay = self.engine.replay
        if replay is not None:  # a benchmark's known continuation (engine/replay.py): the head ran, its tokens go
            if not params.greedy or matcher is not None:
                raise ReplayError("a replayed continuation drafts for greedy, unconstrained requests only")
            draft_tokens = mx.array(replay.drafts(self.request.prompt_tokens, len(self.output.tokens), k),
                                    dtype=mx.uint32)
        if self.engine.config.async_draft_eval:
            mx.async_eval(draft_tokens, *draft_logprobs)
        else:
            mx.eval(draft_tokens, *draft_logprobs)
        return _Drafts(k, draft_tokens, draft_logprobs, masks, catch_up, timed_from)

    def decide(self, drafts: _Drafts, logits: mx.array) -> _Decision:
        """2-3. The verdict on this run's verify rows ``logits`` [k+1, V] (lazy: read back with the caller's
        one host sync): its penalties, grammar, acceptance test and PRNG keys. With no drafts, row 0 is
        chosen as a plain decode step chooses (the same key use: a seed reproduces plain sampling)."""
        k, params = drafts.k, self.params
        draft_tokens = drafts.tokens
        if self.processors:
            logits = mx.concatenate(
                [
                    apply_processors(
                        self.processors, mx.concatenate([self.history, draft_tokens[:i]]), logits[i : i + 1]
                    )
                    for i in range(k + 1)
                ]
            )
        if self.matcher is not None:
            # Row i sees the grammar after the drafts before it: the masks the drafts were chosen under,
            # and for the last row the state after every draft (computed while the verify call runs).
            mx.async_eval(logits)
            self._consume_pending()
            logits = mx.where(mx.stack([*drafts.masks, self.matcher.mask()]), logits, -mx.inf)
        target_logprobs = None
        if k == 0:
            token, target_logprobs = self.sample(logits)
            verdict = Verdict(accepted=mx.zeros((0,), dtype=mx.bool_), replacement=token)
        elif params.greedy:
            verdict = greedy_verdict(logits, draft_tokens, self.tie_margin(logits.dtype))
        else:
            target_logprobs = filtered_logprobs(logits, params)
            verdict = sampling_verdict(target_logprobs, mx.concatenate(drafts.logprobs), draft_tokens, self.keys)
        lp_drafts = lp_replacements = None
        if self.top_logprobs is not None:
            distribution = target_logprobs if target_logprobs is not None else self._row_logprobs(logits)
            lp_replacements = _LogprobRows(distribution, verdict.replacement, self.top_logprobs)
            lp_drafts = _LogprobRows(distribution[:k], draft_tokens, 0)
        return _Decision(drafts, verdict, lp_drafts, lp_replacements)

    def commit(self, decision: _Decision, hidden: mx.array) -> int:
        """4-5. Host side, after the sync: the accepted drafts and the token after them go to the output one by
        one, stopping exactly where the request ends (EOS, a stop string, max_tokens inside an accepted run),
        and this run's state is rolled to the last token added (head cache, grammar, pending token, penalty
        history, stats); ``hidden`` [1, k+1, H] are its verify rows. Returns how many verify rows its backbone
        caches keep: one per token added, so a run that ends inside an accepted run keeps exactly its reply
        (the prefix cache stores it) and never a draft past its finish."""
        k, verdict = decision.drafts.k, decision.verdict
        proposed = decision.drafts.tokens.tolist()
        accepted, decided = accepted_prefix(
            verdict.accepted.tolist(), verdict.decided.tolist() if verdict.decided is not None else None
        )
        if decided:
            emitted = proposed[:accepted] + [verdict.replacement.tolist()[accepted]]
        else:
            # The token after the accepted drafts hinges on a near tie: decode it plainly next.
            emitted = proposed[:accepted]
            self._plain_next = True
            self.recorder.near_tie_fallbacks += 1
        decision.accepted = accepted
        if k > 0:
            self.head_cache.trim(k - 1)
            self.recorder.round(k, accepted)
        if self.matcher is not None:
            self.matcher.rollback(k - accepted)
            if decided:
                self.matcher.consume(emitted[-1])
        emitted = emitted[: self._emit(decision, emitted)]  # (fewer where the output ended inside the run)
        kept_rows = len(emitted)
        if emitted:
            emitted_array = mx.array(emitted, dtype=mx.uint32)
            self.wait_for_head(hidden[:, :kept_rows], emitted_array)  # row i is followed by emitted[i]
            self.pending_token = emitted_array[-1:]
            self._pending_consumed = True
            if self.processors:
                self.history = mx.concatenate([self.history, emitted_array])
        self.pending_emitted = True  # the pending token is the last decided one (or the sequence ended)
        decision.emitted = emitted
        return kept_rows

    def _emit(self, decision: _Decision, emitted: list[int]) -> int:
        """Add ``emitted`` to the output one by one, stopping exactly where the request ends; returns how
        many were added."""
        lp_drafts, lp_replacements = decision.lp_drafts, decision.lp_replacements
        draft_values = lp_drafts.chosen.tolist() if lp_drafts is not None else None
        added = 0
        for i, token in enumerate(emitted):
            entry = None
            if lp_replacements is not None:
                # Row i's distribution; an accepted draft's value from the draft gather, the last token's
                # (correction or bonus) from the replacement gather.
                chosen = draft_values if i < decision.accepted else None
                entry = self._logprob_entry(lp_replacements, i, token, chosen)
            self.output.add(token, entry)
            added += 1
            if self.output.finish is not None:
                break
        return added

    def _stats(self, ttft_s: float, decode_s: float) -> NativeMTPStats:
        rec = self.recorder
        completion = len(self.output.tokens)
        costs = None
        if self.policy is not None and self.policy.costs.device:
            effective = self.policy.effective_costs()
            costs = {
                "beta": [round(b, 3) for b in effective.beta],
                "delta": [round(d, 3) for d in effective.delta],
                "device": effective.device,
                "stages": effective.stages,  # what they were measured through (a pipeline: its stages)
                "plain_ms": round(effective.plain_s * 1000.0, 3) if effective.plain_s else None,
            }
        reason = self.reason
        if self.policy is not None and self.policy.fixed_k == 0:
            reason = "the MTP depth was forced to 0 (plain decoding)"
        elif reason is None and self.policy is not None and not self.track_head:
            reason = (
                "adaptive depth chose plain decoding: on this device a verify call costs too much for "
                "drafts to pay off even at full acceptance"
            )
        elif reason is None and self.batch_sizes and not self.batch_rounds:
            reason = (
                "adaptive depth chose plain decoding for the batch sizes this request decoded in (batched "
                "plain steps were measured to cost less there; see batch_sizes)"
            )
        return NativeMTPStats(
            enabled=self.policy is not None,
            reason=reason,
            mode=self.forward.mode,
            stages=self.forward.stages,
            k=self.policy.fixed_k if self.policy is not None and self.policy.fixed_k is not None else rec.last_k,
            k_fixed=self.policy is not None and self.policy.fixed_k is not None,
            k_histogram=dict(sorted(rec.k_histogram.items())),
            rounds=rec.rounds,
            drafted_tokens=rec.drafted,
            accepted_tokens=rec.accepted_total,
            acceptance_rate=round(rec.accepted_total / rec.drafted, 4) if rec.drafted else 0.0,
            per_position_acceptance=[round(a, 4) for a in rec.per_position()],
            per_position_drafted=rec.per_position_drafted(),
            near_tie_fallbacks=rec.near_tie_fallbacks,
            profile_ms={k: round(v * 1000, 3) for k, v in self._phases.items()} if self._phases else None,
            ttft_ms=round(ttft_s * 1000.0, 3),
            decode_tokens_per_s=round((completion - 1) / decode_s, 3) if completion > 1 and decode_s > 0 else 0.0,
            prompt_tokens=len(self.request.prompt_tokens),
            completion_tokens=completion,
            cached_tokens=self.prefilled,
            prefix_cache=self.engine.prefix_cache.figures() if self.engine.prefix_cache is not None else None,
            costs=costs,
            batch_sizes=dict(sorted(self.batch_sizes.items())),
        )


def verify_round(
    seqs: list[SequenceState],
    drafts: list[_Drafts],
    forward: Forward,
    cache: list[Any],
    logits_of: Callable[[mx.array], mx.array],
    rollback: Callable[[list[Any], int, list[int]], None],
    mark: Callable[[str], None] | None = None,
) -> list[_Decision]:
    """The scored half of one speculative round of ``seqs`` (each with its ``drafts``), solo (one sequence)
    or batched: ONE verify call on rows [B, K+1] (the pending token, the drafts, then the pending token
    again up to the deepest sequence's K: never kept), ``logits_of`` its hiddens ([B, K+1, V]), each
    sequence's ``decide`` on its own rows, ONE host sync, each one's ``commit`` (its tokens emitted), and
    ``rollback(cache, K + 1, kept)`` keeping each sequence's rows of the caches up to its last emitted token
    (``cache``: theirs, one sequence's or a batch's). ``mark``: the phase timer. The chunks are the caller's
    to drain."""
    k = max(d.k for d in drafts)
    lines = []
    for seq, d in zip(seqs, drafts, strict=True):
        assert seq.pending_token is not None
        pending = seq.pending_token.reshape(1)
        lines.append(mx.concatenate([pending, d.tokens, mx.repeat(pending, k - d.k)] if d.k < k else [pending, d.tokens]))
    rows = lines[0][None] if len(lines) == 1 else mx.stack(lines)
    hidden = forward.hidden(rows, cache, verify=True)
    logits = logits_of(hidden)
    decisions = [seq.decide(d, logits[b, : d.k + 1]) for b, (seq, d) in enumerate(zip(seqs, drafts, strict=True))]
    if mark is not None:
        mark("verify_build")
    mx.eval(hidden, *[a for decision in decisions for a in decision.arrays()])
    if mark is not None:
        mark("device_wait")
    one = len(seqs) == 1
    kept = [seq.commit(decision, hidden if one else hidden[b : b + 1])
            for b, (seq, decision) in enumerate(zip(seqs, decisions, strict=True))]
    rollback(cache, k + 1, kept)
    return decisions


_Run = SequenceState  # the name it had (benchmarks and tests of earlier commits import it)
