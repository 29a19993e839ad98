"""Plain vs native-MTP decoding at each depth, measured in one run (``exo bench``).

A benchmark, not a test: it reports ratios measured back to back on the same machine, prompts and
model (speedup = MTP tokens/s / plain tokens/s), the acceptance per draft position, the round costs
beta(K) / delta(K) adaptive depth works with, and whether greedy MTP reproduced plain decoding.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

from pydantic import BaseModel, Field

from .adaptive import expected_speedup
from .costs import catch_up_seconds, measure_costs
from .generate import Engine
from .request import GenerationRequest, GenerationResult
from .sampling import SamplingParams

DEFAULT_PROMPTS = (
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef list_python_files(root):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv=None):\n    parser = argparse.ArgumentParser(",
)
PROJECTED_ACCEPTANCE = 0.8


# The phases of a round (``NativeMTPStats.profile_ms``) outside its verify call and its drafts.
OUTSIDE_PHASES = ("rollback", "emit", "between")


class BenchRow(BaseModel):
    config: str  # "stock mlx-lm" (--baseline), "plain", "k=1", ..., "adaptive"
    k: int | None  # forced depth, None for adaptive
    completion_tokens: int
    decode_seconds: float
    tokens_per_s: float
    speedup: float  # vs plain, same run
    vs_stock: float | None = None  # median over prompts and repeats of (this / stock mlx-lm plain), same round
    vs_stock_quartiles: list[float] | None = None  # [q1, q3] of those ratios: how far one round is from the next
    # Fixed K: a round's measured cost in this run's plain steps (what adaptive depth weighs against plain
    # decoding); its mean time, and the median time of its verify call and K draft steps timed alone just
    # before each of its requests; ``glue``: the median over its requests of the first over the second,
    # what the loop adds around them (host work not hidden, syncs). Seconds against seconds, measured side
    # by side: a live plain step is pipelined (its graph built while the previous step computes), the plain
    # step beta and delta are counted in is not; and a shared machine's speed drifts between minutes.
    round_cost: float | None = None
    round_ms: float | None = None
    alone_ms: float | None = None
    glue: float | None = None
    # A round's head first takes in the verify rows the round before kept (its accepted drafts and the token
    # after them: 1 + accepted drafts per round on average), where the K draft steps timed alone start from
    # one row: ``catch_up_ms`` is what those extra rows cost (timed alone just after each request, at its mean
    # rows), ``glue_with_catch_up`` the round's time over its parts with them (median over requests).
    catch_up_ms: float | None = None
    glue_with_catch_up: float | None = None
    # By the engine's phase timer (``profile_ms``): the share of a round's time outside its verify call and its
    # drafts (reading the verdict back, rollback, emission, the loop between rounds); median over requests.
    outside_share: float | None = None
    # Fixed K: a round's time by phase (``NativeMTPStats.profile_ms``, ms per round, median over requests):
    # draft_build, verify_build, device_wait (its verify call and drafts as the loop runs them), then
    # OUTSIDE_PHASES; set against ``alone_ms`` it says where a round's time beyond its parts goes.
    phases_ms: dict[str, float] | None = None
    acceptance_rate: float
    per_position_acceptance: list[float]
    k_histogram: dict[int, int]
    identical_to_plain: bool | None  # greedy only


class BenchReport(BaseModel):
    model: str
    device: str
    prompts: int
    max_tokens: int
    repeats: int = 1
    temperature: float
    native_mtp_available: bool
    reason: str | None = None
    beta: list[float] = Field(default_factory=list)  # index K-1, in plain steps timed alone (plain_step_alone_ms)
    delta: list[float] = Field(default_factory=list)
    plain_step_alone_ms: float | None = None  # one plain step built, computed and read back (warm-up)
    # (1+.8+...)/(beta+delta), the costs counted in plain tokens of the pipelined decode loop
    projected_speedup_at_0_8: list[float] = Field(default_factory=list)
    plain_identical_to_stock: bool | None = None  # --baseline, greedy: exo's plain tokens == stock mlx-lm's
    # exo's own ops in plain decoding where stock mlx-lm runs MLX's (``own_ops``): plain then computes otherwise
    # than stock, and the identity above is reported, not required
    own_ops: list[str] = Field(default_factory=list)
    rows: list[BenchRow] = Field(default_factory=list)
    # Adaptive against the fixed configuration (plain or k=K) with the most tokens/s in this run: the median
    # over rounds of adaptive's tokens/s / that configuration's in the same round, and its [q1, q3].
    best_fixed: str | None = None
    adaptive_vs_best_fixed: float | None = None
    adaptive_vs_best_fixed_quartiles: list[float] | None = None
    # The same in tight pairs (``pairs``): after the rounds, adaptive and that configuration alone, request after
    # request (order rotated), so each ratio compares moments a request apart, where a round of every
    # configuration spans several (a host's speed moves within one run, and the rounds' median reads lower than
    # tight pairs on the same kind of machine; on noisier hosts tight pairs still swing: docs/performance.md, "The code's reasons":
    # ``exo bench``'s tight pairs).
    # Each group also runs that configuration a second time (the three in an order rotated by one a group): its
    # second run over its first is the figure's noise floor on this host, in the same run (docs/performance.md, "The code's reasons":
    # ``exo bench``'s noise floor).
    paired_groups: int = 0
    adaptive_vs_best_fixed_paired: float | None = None
    adaptive_vs_best_fixed_paired_quartiles: list[float] | None = None
    best_fixed_again_paired: float | None = None
    best_fixed_again_paired_quartiles: list[float] | None = None


def encode_prompt(engine: Engine, text: str, raw: bool) -> list[int]:
    tokenizer = engine.loaded.tokenizer
    if not raw and getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    return list(tokenizer.encode(text))


def run_bench(
    engine: Engine,
    prompts: Sequence[str] = DEFAULT_PROMPTS,
    *,
    max_tokens: int = 128,
    temperature: float = 0.0,
    raw: bool = True,
    repeats: int = 1,
    baseline: bool = False,
    pairs: int = 0,
    progress: Callable[[str], None] | None = None,
) -> BenchReport:
    """Every configuration on every prompt, ``repeats`` times, EOS ignored (every generation is
    ``max_tokens`` long). ``baseline``: stock mlx-lm (its own model classes, ``stream_generate``) decodes
    the same prompt ids in the same round, so each configuration gets a ratio to it per round. Each round
    runs its configurations (stock included) in an order rotated by one from the round before. ``pairs``:
    then that many groups of adaptive and the fastest fixed configuration run twice, request after request."""
    import dataclasses

    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    config = engine.config
    engine.config = dataclasses.replace(config, profile_rounds=True)  # rounds timed by phase (outside_share)
    try:
        return _run_bench(engine, prompts, max_tokens, temperature, raw, repeats, baseline, pairs, progress)
    finally:
        engine.config = config


def _run_bench(engine: Engine, prompts: Sequence[str], max_tokens: int, temperature: float, raw: bool,
               repeats: int, baseline: bool, pairs: int, progress: Callable[[str], None] | None) -> BenchReport:
    from .costs import device_name

    encoded = [encode_prompt(engine, p, raw) for p in prompts]
    reason = engine.mtp_unavailable_reason()
    stock = StockMLXLM(engine.loaded.path) if baseline else None
    report = BenchReport(
        model=engine.loaded.model_id,
        device=device_name(),
        prompts=len(prompts),
        max_tokens=max_tokens,
        repeats=repeats,
        temperature=temperature,
        native_mtp_available=reason is None,
        reason=reason,
        own_ops=own_ops(engine),
    )
    configs: list[tuple[str, int | None, str]] = [("plain", 0, "off")]
    if reason is None:
        costs = engine.costs()
        report.beta = [round(b, 3) for b in costs.beta]
        report.delta = [round(d, 3) for d in costs.delta]
        report.plain_step_alone_ms = round(costs.plain_s * 1e3, 3) if costs.plain_s else None
        report.projected_speedup_at_0_8 = [
            round(expected_speedup(costs.in_pipelined_steps(), [PROJECTED_ACCEPTANCE] * costs.max_k, k), 3)
            for k in range(1, costs.max_k + 1)
        ]
        configs += [(f"k={k}", k, "on") for k in range(1, engine.config.max_k + 1)]
        configs.append(("adaptive", None, "on"))

    def run(tokens: list[int], k: int | None, mode: str, max_new: int, seed: int) -> GenerationResult:
        request = GenerationRequest(
            prompt_tokens=tokens,
            max_tokens=max_new,
            sampling=SamplingParams(temperature=temperature, seed=seed),
            native_mtp=mode,  # type: ignore[arg-type]
            mtp_k=None if mode == "off" else k,
        )
        return engine.complete(request)

    # Warm-up: compile every path once so no configuration pays for kernel compilation, each fixed one over a
    # whole request of the longest prompt (MLX CUDA compiles kernels for longer contexts as they come: after
    # short warm-ups the first measured requests ran their plain tokens slower than later ones, and adaptive
    # depth, timing them live, took rounds for cheap: docs/performance.md, "The code's reasons"). Adaptive's own is short: its
    # learning on the first requests is part of what it is measured on.
    longest = max(encoded, key=len)
    for name, k, mode in configs:
        run(longest, k, mode, 8 if name == "adaptive" else max_tokens, 0)
    if stock is not None:
        stock.decode(longest, max_tokens, temperature)
    per_round: dict[str, list[float]] = {name: [] for name, _, _ in configs}  # tokens/s, one per round

    totals = {name: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0, "same": True, "rounds": 0}
              for name, _, _ in configs}
    position_tests: dict[str, list[int]] = {name: [] for name, _, _ in configs}
    position_hits: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    histograms: dict[str, dict[int, int]] = {name: {} for name, _, _ in configs}
    alone: dict[str, list[float]] = {name: [] for name, _, _ in configs}  # seconds of a round's parts alone
    glue: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    catch_up: dict[str, list[float]] = {name: [] for name, _, _ in configs}  # seconds of the head's extra rows
    glue_caught_up: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    outside: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    phases: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in configs}  # ms per round, per request
    slots: list[tuple[str, int | None, str]] = ([("stock", None, "")] if stock is not None else []) + configs
    for repeat in range(repeats):
        for index, tokens in enumerate(encoded):
            # Each round runs its configurations in a rotated order: on a host whose speed drifts within a
            # run (docs/performance.md, "The code's reasons": rotated rounds), no configuration always runs last, furthest from
            # the stock run it is compared with.
            turn = repeat * len(encoded) + index
            order = slots[turn % len(slots):] + slots[: turn % len(slots)]
            stock_tps: float | None = None
            stock_tokens: list[int] | None = None
            results: dict[str, GenerationResult] = {}
            for name, k, mode in order:
                if name == "stock":
                    assert stock is not None
                    stock_tps, stock_tokens = stock.decode(tokens, max_tokens, temperature)
                    continue
                context = len(tokens) + max_tokens // 2  # the request's mean context
                parts_s = parts_alone(engine, k, context) if k and mode == "on" else None
                start = time.perf_counter()
                result = results[name] = run(tokens, k, mode, max_tokens, 1000 * repeat + index)
                elapsed = time.perf_counter() - start
                stats = result.stats
                total = totals[name]
                total["tokens"] += max(stats.completion_tokens - 1, 0)
                decode_s = max(elapsed - stats.ttft_ms / 1000.0, 1e-9)
                total["seconds"] += decode_s
                if parts_s and stats.rounds:
                    alone[name].append(parts_s)
                    glue[name].append(decode_s / stats.rounds / parts_s)
                    assert k is not None
                    extra = catch_up_alone(engine, k, 1 + stats.accepted_tokens / stats.rounds, context)
                    catch_up[name].append(extra)
                    glue_caught_up[name].append(decode_s / stats.rounds / (parts_s + extra))
                if stats.rounds and stats.profile_ms and k:
                    profile = stats.profile_ms
                    outside[name].append(sum(profile.get(p, 0.0) for p in OUTSIDE_PHASES) / sum(profile.values()))
                    if stats.rounds > 1:  # "between" is counted from a request's second round on
                        phases[name].append({p: ms / (stats.rounds - (p == "between")) for p, ms in profile.items()})
                total["drafted"] += stats.drafted_tokens
                total["accepted"] += stats.accepted_tokens
                total["rounds"] += stats.rounds
                for depth, count in stats.k_histogram.items():
                    histograms[name][depth] = histograms[name].get(depth, 0) + count
                for i, (tests, rate) in enumerate(
                    zip(stats.per_position_drafted, stats.per_position_acceptance, strict=True)
                ):
                    if i == len(position_tests[name]):
                        position_tests[name].append(0)
                        position_hits[name].append(0.0)
                    position_tests[name][i] += tests
                    position_hits[name][i] += rate * tests
                if progress:
                    progress(f"{name:>9}  prompt {index + 1}/{len(encoded)}  {stats.decode_tokens_per_s:8.1f} tok/s")
            baseline = results["plain"].token_ids
            for name, result in results.items():
                per_round[name].append(result.stats.decode_tokens_per_s)
                if temperature > 0.0:
                    continue
                if name == "plain":
                    if stock_tokens is not None:
                        report.plain_identical_to_stock = (
                            report.plain_identical_to_stock is not False and stock_tokens == baseline)
                else:
                    totals[name]["same"] = bool(totals[name]["same"]) and result.token_ids == baseline
            if stock_tps and progress:
                progress(f"{'stock':>9}  prompt {index + 1}/{len(encoded)}  {stock_tps:8.1f} tok/s")
            if stock is not None:
                stock.rounds.append(stock_tps or 0.0)
    plain_tps = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    plain_step_s = 1.0 / plain_tps
    if stock is not None and stock.rounds:
        stock_median = statistics.median(stock.rounds)
        report.rows.append(BenchRow(
            config="stock mlx-lm", k=None, completion_tokens=len(stock.rounds) * (max_tokens - 1),
            decode_seconds=0.0, tokens_per_s=round(stock_median, 2), speedup=round(stock_median / plain_tps, 3),
            acceptance_rate=0.0, per_position_acceptance=[], k_histogram={}, identical_to_plain=None,
            vs_stock=1.0,
        ))
    for name, k, _ in configs:
        total = totals[name]
        # this / stock mlx-lm's plain tokens/s, round by round (every configuration runs in every round)
        ratios = [tps / s for tps, s in zip(per_round[name], stock.rounds, strict=True) if s] if stock is not None else []
        tps = total["tokens"] / total["seconds"]
        report.rows.append(
            BenchRow(
                config=name,
                k=k if name != "adaptive" else None,
                completion_tokens=int(total["tokens"]),
                decode_seconds=round(total["seconds"], 4),
                tokens_per_s=round(tps, 2),
                speedup=round(tps / plain_tps, 3),
                acceptance_rate=round(total["accepted"] / total["drafted"], 4) if total["drafted"] else 0.0,
                per_position_acceptance=[
                    round(h / t, 4) for h, t in zip(position_hits[name], position_tests[name], strict=True)
                ],
                k_histogram=dict(sorted(histograms[name].items())),
                identical_to_plain=None if (name == "plain" or temperature > 0) else bool(total["same"]),
                vs_stock=round(statistics.median(ratios), 3) if ratios else None,
                vs_stock_quartiles=_quartiles(ratios),
                **_round_cost(total, k if name != "adaptive" else None, plain_step_s, alone[name], glue[name],
                              catch_up[name], glue_caught_up[name]),
                outside_share=round(statistics.median(outside[name]), 4) if outside[name] else None,
                phases_ms=_median_phases(phases[name]),
            )
        )
    fixed = [row for row in report.rows if row.config in per_round and row.config != "adaptive"]
    if "adaptive" in per_round and fixed:
        best = max(fixed, key=lambda row: row.tokens_per_s).config
        paired = [a / b for a, b in zip(per_round["adaptive"], per_round[best], strict=True) if b > 0]
        report.best_fixed = best
        report.adaptive_vs_best_fixed = round(statistics.median(paired), 3) if paired else None
        report.adaptive_vs_best_fixed_quartiles = _quartiles(paired)
        if pairs > 0:
            _, best_k, best_mode = next(c for c in configs if c[0] == best)
            roles = [("adaptive", None, "on"), ("best", best_k, best_mode), ("again", best_k, best_mode)]
            ratios, again = [], []
            for group in range(pairs):
                tokens, seed = encoded[group % len(encoded)], 10_000 + group
                turn = group % len(roles)
                speeds = {}
                for role, k, mode in roles[turn:] + roles[:turn]:
                    speeds[role] = run(tokens, k, mode, max_tokens, seed).stats.decode_tokens_per_s
                if speeds["best"] > 0:
                    ratios.append(speeds["adaptive"] / speeds["best"])
                    again.append(speeds["again"] / speeds["best"])
                    if progress:
                        progress(f"pair {group + 1}/{pairs}  adaptive / {best} {ratios[-1]:.3f}  "
                                 f"{best} again / {best} {again[-1]:.3f}")
            report.paired_groups = len(ratios)
            report.adaptive_vs_best_fixed_paired = round(statistics.median(ratios), 3) if ratios else None
            report.adaptive_vs_best_fixed_paired_quartiles = _quartiles(ratios)
            report.best_fixed_again_paired = round(statistics.median(again), 3) if again else None
            report.best_fixed_again_paired_quartiles = _quartiles(again)
    return report


def _median_phases(per_request: list[dict[str, float]]) -> dict[str, float] | None:
    """Per phase, the median over requests of its ms per round (a phase a request did not time counts 0)."""
    if not per_request:
        return None
    order = ("draft_build", "verify_build", "device_wait", *OUTSIDE_PHASES)  # a round's phases as they run
    names = sorted({p for phases in per_request for p in phases}, key=lambda p: (order + (p,)).index(p))
    return {p: round(statistics.median(phases.get(p, 0.0) for phases in per_request), 3) for p in names}


def own_ops(engine: Engine) -> list[str]:
    """The operations of exo's plain decoding on this device that are exo's own where stock mlx-lm runs MLX's
    (docs/architecture.md names them): there plain decoding rounds otherwise than stock."""
    ops = []
    if any(found.startswith("ok") for found in engine.loaded.qgemv.values()):
        ops.append("quantized linear products (engine/kernels/cuda_qgemv.py; EXO_QGEMV=0 for MLX's)")
    if any(found.startswith("ok") for found in engine.loaded.padded.values()):
        ops.append("quantized linear products of few rows padded to MLX's tiled product (engine/models/padded_rows.py; "
                   "EXO_PAD_ROWS=0 for one-row products)")
    if any(found.startswith("ok") for found in engine.loaded.dense.values()):
        ops.append("a prompt chunk's quantized products on dequantized weights (engine/models/prompt_dense.py; "
                   "EXO_PROMPT_DENSE=off for MLX's quantized product)")
    if any(found.startswith("ok") for found in engine.loaded.gdn.values()):
        ops.append("the GatedDeltaNet step (engine/kernels/cuda_gdn.py; EXO_GDN_KERNEL=0 for mlx-lm's ops)")
    return ops


def identity_failures(report: BenchReport) -> list[str]:
    """What a greedy run found not identical (``exo bench --check``): each MTP configuration whose tokens
    differ from plain decoding's, and plain decoding against stock mlx-lm's (with ``--baseline``) where plain
    computes as stock does (no ``own_ops``)."""
    if report.temperature > 0:
        return []
    failures = [f"{row.config}: not plain decoding's tokens" for row in report.rows if row.identical_to_plain is False]
    if report.plain_identical_to_stock is False and not report.own_ops:
        failures.append("plain: not stock mlx-lm's tokens")
    return failures


def _quartiles(values: list[float]) -> list[float] | None:
    """[q1, q3] of ``values`` (None for fewer than two)."""
    if len(values) < 2:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [round(q1, 3), round(q3, 3)]


def parts_alone(engine: Engine, k: int, context: int = 64) -> float | None:
    """Seconds of a depth-k round timed alone now, after ``context`` tokens (a request's mean: its prompt and
    half its completion): its k draft steps and (k+1)-row verify call as a round runs them, without the engine's
    bookkeeping (``costs.measure_costs``; medians of a few repetitions)."""
    head = engine.loaded.head
    if head is None:
        return None
    costs = measure_costs(engine.model, engine.forward, head, k, context=context, statistic=statistics.median)
    assert costs.plain_s is not None
    return costs.round_cost(k) * costs.plain_s


def catch_up_alone(engine: Engine, k: int, rows: float, context: int = 64) -> float:
    """Seconds that k draft steps whose head first takes in ``rows`` rows (a request's mean: interpolated
    between the whole row counts around it) cost beyond those starting from one row, timed alone now."""
    head = engine.loaded.head
    assert head is not None
    rows = min(max(rows, 1.0), k + 1.0)
    low, high = math.floor(rows), math.ceil(rows)
    seconds = catch_up_seconds(engine.model, engine.forward, head, k, sorted({1, low, high}), context=context,
                               statistic=statistics.median)
    at_rows = seconds[low] + (seconds[high] - seconds[low]) * (rows - low)
    return max(0.0, at_rows - seconds[1])


def _round_cost(total: dict, k: int | None, plain_step_s: float, alone: list[float], glue: list[float],
                catch_up: list[float], glue_caught_up: list[float]) -> dict:
    if not k or not total["rounds"]:
        return {}
    round_s = total["seconds"] / total["rounds"]
    out: dict = {"round_cost": round(round_s / plain_step_s, 3), "round_ms": round(round_s * 1e3, 3)}
    if glue:
        out.update(alone_ms=round(statistics.median(alone) * 1e3, 3), glue=round(statistics.median(glue), 3),
                   catch_up_ms=round(statistics.median(catch_up) * 1e3, 3),
                   glue_with_catch_up=round(statistics.median(glue_caught_up), 3))
    return out


class StockMLXLM:
    """Stock mlx-lm on the same checkpoint directory: its own model classes and ``stream_generate``, plain
    decoding (the reference exo's engine must at least match). EOS is ignored, like the engine's runs."""

    def __init__(self, path) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(str(path))
        self.tokenizer.eos_token_ids = set()
        self.rounds: list[float] = []

    def decode(self, prompt: list[int], max_tokens: int, temperature: float) -> tuple[float, list[int]]:
        """(decode tokens/s from the first token to the last, as ``decode_tokens_per_s`` measures; tokens)."""
        import mlx.core as mx
        from mlx_lm import stream_generate
        from mlx_lm.sample_utils import make_sampler

        first = last = 0.0
        tokens: list[int] = []
        prompt_array = mx.array(prompt)
        for response in stream_generate(self.model, self.tokenizer, prompt_array, max_tokens=max_tokens,
                                        sampler=make_sampler(temp=temperature)):
            last = time.perf_counter()
            if not tokens:
                first = last
            tokens.append(int(response.token))
        count = len(tokens)
        return ((count - 1) / (last - first) if count > 1 and last > first else 0.0), tokens

