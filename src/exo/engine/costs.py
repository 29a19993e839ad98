"""Warm-up measurement of speculative round costs on this machine (beta(K), delta(K)).

beta(K): a (K+1)-row verify call of the backbone, relative to a one-row decode step.
delta(K): what drafting K tokens with the MTP head (head layer + lm_head per token) adds to a round beyond its
verify call, same unit: a whole round is timed as the engine runs it (the drafts evaluated while the verify graph
is built on them, one host sync), beta + delta its cost.
The unit, one plain step built, computed and read back, is not what a plain token costs in the decode loop,
which builds each step while the previous one computes: that is timed too (``plain_pipelined_s``), and the
adaptive policy compares rounds with it (a step alone costs more than a pipelined one, so against steps
alone rounds looked cheaper than they are next to plain decoding: docs/performance.md, "The code's reasons").
Measured on a short random context, verify calls rolled back after each timed call, every part timed once per
repetition in turn after warm-up calls (the first calls compile kernels): a plain step is the fastest of its
repetitions (other work on the machine only adds time), beta and delta the median over repetitions of each part
over the plain step timed beside it (a host's speed can swing within seconds).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .adaptive import WARM_COST_DOUBT, DepthCosts, can_pay_off
from .forward import Forward
from .models.mtp import MTPHead
from .verify import verify_logits


def device_name() -> str:
    device = mx.default_device()
    if device.type == mx.gpu:
        if mx.metal.is_available():
            info = mx.metal.device_info() if hasattr(mx.metal, "device_info") else {}
            return f"metal ({info.get('device_name', 'Apple GPU')})"
        try:
            return f"cuda ({mx.cuda.device_info().get('device_name', 'GPU')})"  # type: ignore[attr-defined]
        except Exception:
            return "cuda"
    import platform

    from .kernels import status

    kernel = status()  # exo's CPU matmul, or why MLX's runs (costs and bench figures differ by far)
    return f"cpu ({platform.machine()}, matmul: {'exo kernel' if kernel == 'built' else 'MLX (' + kernel + ')'})"


Statistic = Callable[[list[float]], float]
PIPELINED_STEPS = 8  # plain steps per timed burst of the pipelined decode loop
# Warm-ups after the first while it says drafting cannot pay off at all (its costs doubted as the depth policy
# doubts them, ``adaptive.WARM_COST_DOUBT``): that verdict turns adaptive MTP off for the engine's life, so a
# moment of interference must not decide it (it once did on an H100: docs/performance.md, "The code's
# reasons": ``CONFIRM_WARMUPS``).
CONFIRM_WARMUPS = 2


def _interleaved(fns: dict[Any, Callable[[], None]], reps: int, warmup: int = 2) -> dict[Any, list[float]]:
    """Seconds of ``reps`` timed calls of each of ``fns``, round-robin (each repetition times every one of them
    once, in turn), after ``warmup`` untimed calls of each: the parts of one repetition are timed within moments
    of each other."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[Any, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def ratio_of(parts: list[float], units: list[float]) -> float:
    """The median over repetitions of a part's time over the unit's timed beside it. On a host whose speed swings
    within seconds, each part's fastest time (``min``) can come from another moment than the unit's, and the
    costs it gives can be far from the live ones (docs/performance.md, "The code's reasons": round costs as medians of ratios)."""
    return statistics.median(p / u for p, u in zip(parts, units, strict=True) if u > 0)


def fastest(a: DepthCosts, b: DepthCosts) -> DepthCosts:
    """Two warm-ups of the same model combined: each part's fastest time (interference only adds time)."""
    if not a.plain_s or not b.plain_s:
        return a
    plain = min(a.plain_s, b.plain_s)

    def parts(x: tuple[float, ...], y: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(min(u * a.plain_s, v * b.plain_s) / plain for u, v in zip(x, y, strict=True))  # type: ignore[operator]

    pipelined = min(a.plain_pipelined_s or plain, b.plain_pipelined_s or plain)
    return DepthCosts(tuple(max(1.0, v) for v in parts(a.beta, b.beta)), parts(a.delta, b.delta), a.device, plain,
                      a.stages, pipelined)


def warmup_costs(
    model: Any, forward: Forward, head: MTPHead, max_k: int, stop: Callable[[], bool] | None = None,
    phases: dict[str, float] | None = None,
) -> DepthCosts | None:
    """``measure_costs`` for the adaptive policy: a warm-up that finds drafting cannot pay off even with every
    draft accepted is confirmed by up to ``CONFIRM_WARMUPS`` more, each part's fastest time kept. ``stop`` is
    polled between measurements (the request that waits on the warm-up was cancelled or ran out of time):
    then None, nothing measured kept. ``phases`` gets each measurement's seconds ("round costs", "round costs
    again N": the first includes compiling every kernel of the verify calls and drafts, which MLX CUDA does at
    their first launch)."""
    start = time.perf_counter()
    costs = measure_costs(model, forward, head, max_k)
    if phases is not None:
        phases["round costs"] = time.perf_counter() - start
    for again in range(1, CONFIRM_WARMUPS + 1):
        if can_pay_off(costs.in_pipelined_steps(), costs.max_k, doubt=WARM_COST_DOUBT):
            break  # (the verdict to confirm is the one that turns adaptive MTP off: ``DepthPolicy.mtp_can_pay_off``)
        if stop is not None and stop():
            return None
        start = time.perf_counter()
        costs = fastest(costs, measure_costs(model, forward, head, max_k))
        if phases is not None:
            phases[f"round costs again {again}"] = time.perf_counter() - start
    return costs


def _primed(model: Any, forward: Forward, head: MTPHead, context: int) -> tuple[mx.array, list[Any], KVCache, mx.array]:
    """A random context of ``context`` tokens through the backbone and the head: (tokens, backbone caches,
    head cache, hiddens). The caller ends the caches (``forward.end``)."""
    vocab = model.text_model.embed_tokens.weight.shape[0]
    tokens = mx.random.randint(0, vocab, (1, context), key=mx.random.key(0))
    cache = forward.new_cache()
    head_cache = KVCache()
    try:
        hidden = forward.hidden(tokens, cache)
        head(model.embed(tokens[:, 1:]), hidden[:, :-1], head_cache)
        mx.eval(hidden, head_cache.state)
    except BaseException:
        forward.end(cache)
        raise
    return tokens, cache, head_cache, hidden


def _drafts(model: Any, head: MTPHead, head_cache: KVCache, tokens: mx.array, hidden: mx.array, k: int) -> Callable[[], None]:
    """k draft steps as a round runs them: the head first takes in the rows ``hidden`` [1, r, H] (followed by
    ``tokens`` [1, r]), its last row drafts the first token, then it chains on its own output; its cache is
    rewound after each call."""
    offset = head_cache.offset

    def run() -> None:
        mx.eval(_draft_tokens(model, head, head_cache, tokens, hidden, k))
        head_cache.trim(head_cache.offset - offset)

    return run


def _draft_tokens(model: Any, head: MTPHead, head_cache: KVCache, tokens: mx.array, hidden: mx.array,
                  k: int) -> list[mx.array]:
    """k greedy drafts (lazy), as ``_drafts`` describes; the head's cache moves on by their rows."""
    out = head(model.embed(tokens), hidden, head_cache)[:, -1:]
    drafts = [mx.argmax(model.logits(out)[:, -1], axis=-1)]
    for _ in range(k - 1):
        out = head(model.embed(drafts[-1][None]), out, head_cache)
        drafts.append(mx.argmax(model.logits(out)[:, -1], axis=-1))
    return drafts


def catch_up_seconds(
    model: Any, forward: Forward, head: MTPHead, k: int, rows: Sequence[int], *, context: int = 64, reps: int = 5,
    statistic: Statistic = min,
) -> dict[int, float]:
    """Seconds of k draft steps whose first head call takes in r rows, for each r of ``rows``: a round's head
    first takes in the verify rows the round before kept (1 to K+1: its accepted drafts and the token after
    them), which ``measure_costs``' delta(K) (one row) leaves out."""
    tokens, cache, head_cache, hidden = _primed(model, forward, head, context)
    try:
        # The row counts timed side by side, like the warm-up's parts: callers take differences of them.
        times = _interleaved({r: _drafts(model, head, head_cache, tokens[:, -r:], hidden[:, -r:], k) for r in rows}, reps)
        return {r: statistic(times[r]) for r in rows}
    finally:
        forward.end(cache)


def measure_costs(
    model: Any,
    forward: Forward,
    head: MTPHead,
    max_k: int,
    *,
    context: int = 64,
    reps: int = 5,
    statistic: Statistic = min,
) -> DepthCosts:
    """beta(K) and delta(K) relative to one plain step, through ``forward`` (a pipeline's costs include
    its stages and the transfers between them: that is what a round costs there). ``statistic`` of the
    timed repetitions: the fastest for the warm-up; ``exo bench`` compares live rounds with medians."""
    tokens, cache, head_cache, hidden = _primed(model, forward, head, context)
    try:
        last_hidden = hidden[:, -1:]
        one = tokens[:, :1]

        def plain() -> None:
            # The context grows by one per call (a pipeline's other stages cannot be rewound): a few tokens
            # more than the verify calls see, which changes nothing measurable.
            mx.eval(mx.argmax(model.logits(forward.hidden(one, cache))[:, -1], axis=-1))

        def plain_burst() -> None:
            # As the decode loop runs them: each step's graph built while the previous step computes.
            token = mx.argmax(model.logits(forward.hidden(one, cache))[:, -1], axis=-1)
            mx.async_eval(token)
            for _ in range(PIPELINED_STEPS - 1):
                following = mx.argmax(model.logits(forward.hidden(token.reshape(1, 1), cache))[:, -1], axis=-1)
                mx.async_eval(following)
                token.item()
                token = following
            token.item()

        def verify(k: int) -> Callable[[], None]:
            rows = mx.concatenate([one] * (k + 1), axis=1)

            def run() -> None:
                out = forward.hidden(rows, cache, verify=True)
                # Its logits as a round computes them (per row where this device needs it: ``verify.probe``).
                mx.eval(mx.argmax(verify_logits(model, out, forward.verify), axis=-1))
                forward.rollback(cache, k + 1, 0)

            return run

        def whole_round(k: int) -> Callable[[], None]:
            # As a round runs (``round.draft``, ``round.build_verify``): the drafts' evaluation started, the verify
            # graph built on them meanwhile, one host sync, the caches rolled back.
            offset = head_cache.offset

            def run() -> None:
                tokens = mx.concatenate(_draft_tokens(model, head, head_cache, one, last_hidden, k)).astype(one.dtype)
                mx.async_eval(tokens)
                hidden = forward.hidden(mx.concatenate([one, tokens[None]], axis=1), cache, verify=True)
                mx.eval(mx.argmax(verify_logits(model, hidden, forward.verify), axis=-1))
                forward.rollback(cache, k + 1, 0)
                head_cache.trim(head_cache.offset - offset)

            return run

        # Every part timed once per repetition, in turn: beta and the round's cost are medians of ratios to the
        # plain step timed beside them, not one moment's fastest verify over another moment's fastest plain step.
        ks = range(1, max_k + 1)
        times = _interleaved(
            {"plain": plain, "burst": plain_burst, **{f"verify{k}": verify(k) for k in ks},
             **{f"round{k}": whole_round(k) for k in ks}},
            reps,
        )
        plain_s = statistic(times["plain"])
        pipelined_s = statistic(times["burst"]) / PIPELINED_STEPS
        # A verify of K+1 rows never really costs less than one row; timer noise on tiny models can say so.
        beta = tuple(max(1.0, ratio_of(times[f"verify{k}"], times["plain"])) for k in ks)
        # What drafting adds to a round beyond its verify call: the drafts' device work partly hides behind the
        # verify graph's building, so their cost timed alone (head and lm_head, evaluated) over-counted it, more so
        # the deeper the round (an H200's 9B at K = 3: 3.49 plain steps by parts, 1.77 live).
        delta = tuple(max(0.0, ratio_of(times[f"round{k}"], times["plain"]) - b) for k, b in zip(ks, beta, strict=True))
    finally:
        forward.end(cache)
    return DepthCosts(beta=beta, delta=delta, device=device_name(), plain_s=plain_s, stages=forward.stages,
                      plain_pipelined_s=pipelined_s)


def active_weight_bytes(model: Any) -> int:
    """Weight bytes one decode step reads from ``model``'s parameters (this process's part of the model): an MoE
    block's experts counted at top_k / experts (a token reads its routed experts only), everything else whole."""
    from mlx.utils import tree_flatten

    total = 0.0
    for _, module in model.named_modules():
        switch = getattr(module, "switch_mlp", None)
        if switch is None:
            continue
        share = min(1.0, module.top_k / max(1, module.num_experts))
        total -= (1.0 - share) * sum(v.nbytes for _, v in tree_flatten(switch.parameters()))
    return int(total + sum(v.nbytes for _, v in tree_flatten(model.parameters())))


def decode_bytes_per_s(model: Any, forward: Forward, costs: DepthCosts | None = None, steps: int = 16) -> float:
    """Weight bytes a plain decode step of a whole model on this machine reads per second (its measured speed, the
    unit placement's estimates of other splits are made of): the warm-up's pipelined plain step when it measured
    one (``costs``), else a burst of ``steps`` pipelined plain steps timed here."""
    step_s = (costs.plain_pipelined_s or costs.plain_s) if costs is not None else None
    if not step_s:
        cache = forward.new_cache()
        try:
            token = mx.array([[0]], dtype=mx.uint32)
            for timed in (False, True):  # the first burst compiles and warms up
                started = time.perf_counter()
                for _ in range(steps):
                    following = mx.argmax(model.logits(forward.hidden(token, cache))[:, -1], axis=-1).reshape(1, 1)
                    mx.async_eval(following)
                    token = following
                token.item()
                if timed:
                    step_s = (time.perf_counter() - started) / steps
        finally:
            forward.end(cache)
    return active_weight_bytes(model) / step_s if step_s else 0.0
