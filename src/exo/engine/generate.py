"""The engine: one loaded model, how it decodes (``EngineConfig``), and the entry of a generation.

``Engine.start(request)`` validates a request and returns its ``SequenceState`` (engine/sequence.py), its
depth policy chosen (forced, adaptive after the engine's one-time warm-up, or none) and a cached prefix of its
prompt restored; ``Engine.generate`` decodes it alone as a batch of one (engine/batch.py). The pieces: a
sequence's parts (``sequence``, ``head_rows``, ``choice``, ``output``, ``stats``), a round's (``round``), the
depth of each step (``depth``, ``adaptive``), the batch that drives them all (``batch``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Literal

import mlx.core as mx

from .adaptive import (
    AcceptanceTracker,
    BatchDepthPolicy,
    DepthCosts,
    DepthPolicy,
    trace_from_env,
)
from .batch import decode_alone
from .constraints import ConstraintSpec, Grammar, ToolFormat, compile_grammar
from .costs import warmup_costs
from .forward import Forward, LocalForward
from .kernel_warmup import on_cuda, warm_products
from .loader import LoadedModel
from .models.layers import GdnPrefill, MoEVerifyMode
from .prefix_cache import PrefixCache, restore_prefix
from .replay import ReplayDrafter
from .request import (
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    MTPSwitch,
    NativeMTPMode,
    NativeMTPUnavailableError,
    TokenLogprob,
    check_request,
)
from .sampling import SamplingParams
from .sequence import SequenceState
from .verify import VerifyMode, VerifyRows, probe

log = logging.getLogger(__name__)

GRAMMAR_CACHE = 16  # compiled grammars an engine keeps

WARM_QUESTION = "Explain how a rainbow forms, in a few sentences."
WARM_TOKENS = 64  # ~20 rounds at K = 3 of a trained head
WARM_ROUNDS = 24  # and at most this many rounds (a head whose drafts all fail makes a token a round)


# A prompt's chunk by device (docs/performance.md, "The engine's constants"). A chunk's causal attention computes
# its rows against every key up to its end, the masked half included: on the CPU a smaller chunk wastes less, and
# 512 prefilled exo-demo's 1,758 tokens in 0.49 s against 0.82 s at 2,048 (exo-demo-moe's 3,000: 2.15 vs 2.52 s;
# 256 within 5% of 512). On a GPU a chunk's fixed costs weigh more: 2,048 (an H200 ran 4,096 at 1.02-1.25x).
CPU_PREFILL_CHUNK = 512
GPU_PREFILL_CHUNK = 2048


def default_prefill_chunk() -> int:
    return CPU_PREFILL_CHUNK if mx.default_device() == mx.cpu else GPU_PREFILL_CHUNK


# A running batch's step budget of prompt tokens by device (runner.scheduler; docs/performance.md, "The engine's
# constants"). Each prefill call of a GPU step is host-bound (its launches) whatever its rows, so on an H200 at 9B a
# small budget made 32 clients' prompts trickle in, a call each: 256 -> 2,048 took them from 4.0x one client to
# 7.0x, their first tokens p50 from 0.66 to 0.28 s, a running stream's longest step 182 -> 270 ms. Elsewhere a
# chunk costs its tokens' compute (the CPU; Apple GPUs, unmeasured there): 256 keeps a stream's wait short.
BATCH_PREFILL_CHUNK = 256
CUDA_BATCH_PREFILL_CHUNK = 2048


def default_batch_prefill_chunk() -> int:
    return CUDA_BATCH_PREFILL_CHUNK if on_cuda() else BATCH_PREFILL_CHUNK


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
    # A batch of one decoding greedily builds its next speculative round while a round computes, assuming the
    # round keeps all its drafts (engine.ahead: the host's graph building hidden behind the device's work;
    # rejected, every state it touched is put back). Off until a device gains from it (EXO_NATIVE_MTP_ROUND_AHEAD):
    # it overlaps the host's build with the device's work, and neither measured device had device work to hide
    # it behind. A 2-core CPU (the build takes the cores the computation runs on): K = 1-3 rounds 9-16% dearer;
    # an H200 at 9B, where MLX CUDA's eval is the host launching ~700 kernels as fast as the device runs them:
    # 3-22% dearer (docs/performance.md). Where the device is the bottleneck (bandwidth-bound Apple GPUs, larger
    # models) it should pay: unmeasured. "chain": the next round built on the round's verdict as the device holds
    # it, whatever it kept, and launched before the host reads it (``engine.ahead.ChainedRound``): the device need
    # not wait on the host between rounds; the same tokens (tests/engine/test_chain.py); unmeasured on a GPU.
    round_ahead: Literal["on", "off", "chain"] = "off"
    # Prompt tokens one prefill chunk feeds the model at most. None: the device's (``default_prefill_chunk``):
    # CPU_PREFILL_CHUNK on MLX's CPU backend, GPU_PREFILL_CHUNK on a GPU.
    prefill_chunk: int | None = None
    # Prompt tokens a step of a running batch prefills in all (runner.scheduler's step budget): the batch decodes
    # a step between chunks, so a long prompt holds its streams for a chunk, not for the whole prompt (docs/performance.md,
    # "The engine's constants"). None: the device's (``default_batch_prefill_chunk``).
    batch_prefill_chunk: int | None = None
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


class Engine:
    """Generates from one loaded model. Not thread-safe: callers serialize requests."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, forward: Forward | None = None):
        """``forward``: how the backbone runs; by default here (``LocalForward``), or through the stages of
        a pipeline (``exo.engine.pipeline.PipelineForward``, on the last stage)."""
        self.loaded = loaded
        self.config = config or EngineConfig()
        if self.config.prefill_chunk is None:
            self.config = replace(self.config, prefill_chunk=default_prefill_chunk())
        if self.config.batch_prefill_chunk is None:
            self.config = replace(self.config, batch_prefill_chunk=default_batch_prefill_chunk())
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
        # bytes set aside for a full batch's recurrent states (``batch_memory.state_room``: a server sets it at load)
        self.state_room = 0
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

    # -- native MTP availability -------------------------------------------------------------------
    def mtp_unavailable_reason(self, mode: NativeMTPMode = "auto", switch: MTPSwitch | None = None) -> str | None:
        """Why a request in ``mode`` cannot draft (None: it can); ``switch``: the serving node's switch, else
        the engine's own setting decides."""
        if mode == "off":
            return "native MTP was turned off for this request"
        enabled, why = (switch.enabled, switch.disabled_reason) if switch is not None else (
            self.config.native_mtp_enabled, self.config.disabled_reason)
        if not enabled:
            return why
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
        """What the first requests would otherwise pay for: MLX CUDA's kernels for the products a batch reaches
        (``kernel_warmup``), and for the first adaptive request the round costs and the head's acceptance."""
        head = self.loaded.head
        for kind, seconds in warm_products([self.model] + ([head] if head is not None else [])).items():
            self.warmup_seconds[kind] = seconds
        if self.mtp_unavailable_reason() is None:
            self._adaptive_policy()

    # -- generation --------------------------------------------------------------------------------
    def generate(self, request: GenerationRequest) -> Iterator[GenerationChunk]:
        """``request`` decoded alone (a batch of one), chunk by chunk."""
        return decode_alone(self.start(request))

    def stream(self, run: SequenceState) -> Iterator[GenerationChunk]:
        """A started run (``start``) decoded alone, chunk by chunk; however it ends, its caches are dropped."""
        return decode_alone(run)

    def start(self, request: GenerationRequest) -> SequenceState:
        """A validated run of ``request`` (nothing computed yet): ``stream()`` it alone, or hand it to a
        ``BatchDecoder`` (exo.engine.batch) once ``begin()`` has emitted its first token."""
        check_request(request, self.vocab_size, self.loaded.context_length)
        reason = self.mtp_unavailable_reason(request.native_mtp, request.mtp_switch)
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
            if self.config.warm_acceptance and policy.mtp_can_pay_off:
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
        round; None when it stopped the warm-up. Under a replayed continuation (``Engine.replay``, a benchmark) the
        answer is the replay's first prompt and its drafts the replay's, so the warm acceptance is the replayed one."""
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
        tokens = WARM_TOKENS
        if self.replay is not None:
            prompt, continuation = self.replay.warm_prompt()
            tokens = min(tokens, max(1, len(continuation)))
        else:
            try:
                prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
            except Exception:  # noqa: BLE001 - a tokenizer without a chat template
                prompt = list(tokenizer.encode(WARM_QUESTION))
        fixed = DepthPolicy(costs=self._costs_or_unmeasured(k), max_k=k, fixed_k=k)
        request = GenerationRequest(prompt, max_tokens=tokens, sampling=SamplingParams(temperature=0.0),
                                    native_mtp="on", ignore_eos=True, should_stop=should_stop)
        for _ in decode_alone(SequenceState(self, request, fixed, None)):
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
