"""Adaptive depth against fixed depths, strictly alternating: the pairs ``exo bench`` cannot isolate.

    python bench/adaptive_vs_fixed.py [MODEL] [--max-tokens 160] [--repeats 6] [--depths 0 1 2 3] [--control]
        [--reference FILE] [--tracker NAME=VALUE ...] [--policy NAME=VALUE ...] [--save FILE] [--pool FILE ...]

For each repeat and each of ``exo bench``'s prompts, greedy, EOS ignored: adaptive depth, then every fixed
depth in ``--depths`` (0: plain decoding), the order of the whole group rotated by one each time and drawn
anew (a random permutation) every full cycle of rotations: every configuration runs in every place equally
often, after neighbours that change (with one fixed cyclic order, "k=3 again" over "k=3" read 0.983 over 120
groups on this CPU, its 90% interval 0.961-0.997: what runs just before a request is part of its timing). Adaptive
keeps the engine's one policy across requests, as a server does. Prints the median tokens/s of each (first
to last token), adaptive's depth histogram, and the median and quartiles of the ratios adaptive / fixed K
over requests of the same prompt run seconds apart: on a shared machine whose speed drifts, a bench that
runs five configurations a prompt compares moments a minute apart, these compare neighbours.

``--control`` runs every fixed depth a second time in each group ("plain again", "k=3 again", in the rotated
order like the rest) and prints the same median ratio between the two runs of one configuration: the metric's
own noise floor on this host, in the same run (on H200s whose speed swings within seconds, two runs of one
fixed depth read 0.976-1.008x each other over 48-80 groups).

``--reference FILE`` adds "adaptive reference": a second engine on the same checkpoint whose policy is FILE's
``DepthPolicy`` (an ``adaptive.py`` of another commit: ``git show 676179e:src/exo/engine/adaptive.py > old.py``),
built on that engine's warm-up costs and seeded with its warm-up acceptance as the engine seeds its own: two
policies judged request by request in one run. With ``--fixed-reference`` each fixed depth K >= 1 runs a second
time as "k=K reference", its forced-depth policy an object of FILE's class (the engine builds it through
``generate.DepthPolicy``, patched for those requests): whether a forced depth's speed moved with the policy.

``--control`` also prints adaptive over the mean of a fixed depth's two runs in its group ("both runs"): a
reference with half the noise of either run.

``--policy NAME=VALUE ...`` adds "adaptive variant": another engine on the same checkpoint whose depth policy has
those fields (``DepthPolicy``), ``--tracker NAME=VALUE ...`` the same for its acceptance tracker; values are Python
literals (``--policy can_draft=True entry_gain=100.0 probe_every=1000000000``: an engine that tracks the head and
never drafts, the cost of adaptive's plain decoding without its probes).

``--save FILE`` writes the run's tokens/s per group as JSON; ``--pool FILE ...`` prints the figures of several
saved runs pooled (their groups side by side) and runs nothing. Every median comes with a 90% bootstrap
interval (groups resampled): how far the run's median could sit from the host's.
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import importlib
import importlib.util
import json
import os
import random
import statistics
import sys
from unittest import mock

from exo.engine import GenerationRequest, SamplingParams, load
from exo.engine.adaptive import TRACE_ENV, DepthPolicy
from exo.engine.bench import DEFAULT_PROMPTS, encode_prompt

generate = importlib.import_module("exo.engine.generate")  # the module (its DepthPolicy, patched by --fixed-reference)

BOOTSTRAP = 2000  # resamples behind each median's interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--control", action="store_true", help="each fixed depth twice a group: the noise floor")
    parser.add_argument("--reference", metavar="FILE", help="an 'adaptive reference' engine: FILE's DepthPolicy")
    parser.add_argument("--fixed-reference", action="store_true",
                        help="with --reference: each fixed depth K >= 1 also as 'k=K reference', under FILE's class")
    parser.add_argument("--tracker", nargs="*", default=[], metavar="NAME=VALUE",
                        help="an 'adaptive variant' engine whose acceptance tracker has these fields")
    parser.add_argument("--policy", nargs="*", default=[], metavar="NAME=VALUE",
                        help="an 'adaptive variant' engine whose depth policy has these fields")
    parser.add_argument("--save", metavar="FILE", help="also write the run's tokens/s per group as JSON (for --pool)")
    parser.add_argument("--pool", nargs="+", metavar="FILE", help="print several saved runs' figures pooled; run nothing")
    args = parser.parse_args()
    if args.pool:
        runs = []
        for path in args.pool:
            with open(path) as f:
                runs.append(json.load(f))
        report(runs)
        return
    engine = load(args.model)
    if (reason := engine.mtp_unavailable_reason()) is not None:
        raise SystemExit(f"{args.model}: native MTP unavailable: {reason}")
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    prompts = [encode_prompt(engine, p, True) for p in DEFAULT_PROMPTS]
    configs: list[tuple[str, int | None]] = [("adaptive", None)] + [
        ("plain" if k == 0 else f"k={k}", k) for k in args.depths
    ]
    if args.control:
        configs += [(f"{name} again", k) for name, k in configs if k is not None]
    engines = {name: engine for name, _ in configs}
    def second_engine(name: str) -> DepthPolicy:
        """Another engine on the same checkpoint, run as adaptive config ``name``: its policy (traced apart)."""
        other = load(args.model)
        other.loaded = dataclasses.replace(other.loaded, eos_token_ids=frozenset())
        trace = os.environ.get(TRACE_ENV)
        if trace:  # its policy traces to a file of its own: FILE.reference, FILE.variant
            os.environ[TRACE_ENV] = f"{trace}.{name.split()[-1]}"
        policy = other._adaptive_policy()
        if trace:
            os.environ[TRACE_ENV] = trace
        engines[name] = other
        configs.insert(1, (name, None))
        return policy

    reference_class = None
    if args.reference:
        second_engine("adaptive reference")
        reference_class = reference(engines["adaptive reference"], args.reference)
        if args.fixed_reference:  # each fixed depth again, its fixed policy the reference's class
            configs += [(f"{name} reference", k) for name, k in configs if k]
            engines.update({f"{name} reference": engines["adaptive reference"] for name, k in configs if k})
    if args.tracker or args.policy:
        variant = second_engine("adaptive variant")
        for target, items in ((variant.tracker, args.tracker), (variant, args.policy)):
            for item in items:
                name, value = item.split("=")
                setattr(target, name, ast.literal_eval(value))
    histogram: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)

    def run(name: str, prompt: list[int], k: int | None, max_tokens: int) -> float:
        request = GenerationRequest(
            prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=0),
            native_mtp="off" if k == 0 else "on", mtp_k=None if k in (None, 0) else k,
        )
        if reference_class is not None and k and name.endswith(" reference"):
            with mock.patch.object(generate, "DepthPolicy", reference_class):
                stats = engines[name].complete(request).stats
        else:
            stats = engines[name].complete(request).stats
        if k is None and max_tokens == args.max_tokens:
            histogram[name].update(stats.k_histogram)  # rounds per depth (K = 0: plain tokens)
        return stats.decode_tokens_per_s

    longest = max(prompts, key=len)
    for name, k in configs:  # warm-up: every path compiled once over a whole request (adaptive: a short one)
        run(name, longest, k, 16 if k is None else args.max_tokens)
    tps: dict[str, list[float]] = {name: [] for name, _ in configs}
    turn, shuffle, cycle = 0, random.Random(1), list(configs)
    for _ in range(args.repeats):
        for prompt in prompts:
            if turn % len(configs) == 0:  # a new cycle: new neighbours, each configuration once in each place
                shuffle.shuffle(cycle)
            order = cycle[turn % len(cycle):] + cycle[: turn % len(cycle)]
            turn += 1
            for name, k in order:
                tps[name].append(run(name, prompt, k, args.max_tokens))
            print(f"group {turn}: " + ", ".join(f"{name} {v[-1]:.1f}" for name, v in tps.items()), file=sys.stderr,
                  flush=True)  # as it goes: a run cut short still says something
    run_info = {"model": args.model, "device": engine.costs().device, "max_tokens": args.max_tokens,
                "tps": tps, "histogram": {name: dict(c) for name, c in histogram.items()}}
    if args.save:
        with open(args.save, "w") as f:
            json.dump(run_info, f)
    report([run_info])


def reference(engine, path: str) -> type:
    """Gives ``engine`` the ``DepthPolicy`` of the module at ``path``, warmed up as ``Engine`` warms its own;
    returns that class."""
    spec = importlib.util.spec_from_file_location("adaptive_reference", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    costs, config = engine.costs(), engine.config
    policy = module.DepthPolicy(costs=costs, max_k=config.max_k, default_k=config.default_k)
    if config.warm_acceptance and module.can_pay_off(costs, config.max_k):
        policy.tracker.absorb(engine.warm_acceptance())
    engine._policy, engine._policy_key = policy, (config.max_k, config.default_k)
    return module.DepthPolicy


def median_line(ratios: list[float]) -> str:
    """Median and quartiles of paired ratios, and a 90% bootstrap interval of the median (groups resampled):
    how far this run's median could sit from the host's, its noise in one figure."""
    q1, _, q3 = statistics.quantiles(ratios)
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP))
    low, high = medians[int(0.05 * BOOTSTRAP)], medians[int(0.95 * BOOTSTRAP) - 1]
    return f"median {statistics.median(ratios):.3f} (quartiles {q1:.3f} / {q3:.3f}; 90% interval {low:.3f}-{high:.3f})"


def report(runs: list[dict]) -> None:
    """Print one run's figures, or several runs' pooled (``--pool``: their groups side by side)."""
    names = [name for name in runs[0]["tps"] if all(name in run["tps"] for run in runs)]
    tps = {name: [v for run in runs for v in run["tps"][name]] for name in names}
    first = runs[0]
    where = first["device"] if len(runs) == 1 else f"{len(runs)} runs pooled ({', '.join(sorted({r['device'] for r in runs}))})"
    print(f"{first['model']} on {where}: {len(tps['adaptive'])} groups of {first['max_tokens']} tokens; "
          "median tokens/s " + ", ".join(f"{name} {statistics.median(v):.1f}" for name, v in tps.items()))
    for name in names:
        if name.startswith("adaptive"):
            counts: collections.Counter[int] = collections.Counter()
            for run in runs:
                counts.update({int(k): v for k, v in run["histogram"].get(name, {}).items()})
            print(f"  {name}: rounds per depth (K = 0: plain tokens) {dict(sorted(counts.items()))}")
    adaptive = [name for name in names if name.startswith("adaptive")]
    for a in adaptive[1:]:
        print(f"  {a} / adaptive: " + median_line([x / y for x, y in zip(tps[a], tps["adaptive"], strict=True)]))
    for name in names:  # --fixed-reference: a forced depth under this commit's policy class and the reference's
        base = name.removesuffix(" reference")
        if base != name and not name.startswith("adaptive") and base in tps:
            print(f"  {base} / {name}: " + median_line([x / y for x, y in zip(tps[base], tps[name], strict=True)]))
    for name in names:
        if name.startswith("adaptive") or name.endswith(" again"):
            continue
        if f"{name} again" in tps:
            ratios = [x / f for x, f in zip(tps[f"{name} again"], tps[name], strict=True)]
            print(f"  {name} again / {name} (the noise floor): " + median_line(ratios))
        if "plain" in tps and name != "plain":
            ratios = [f / p for f, p in zip(tps[name], tps["plain"], strict=True)]
            print(f"  {name} / plain: median {statistics.median(ratios):.3f}")
        for a in adaptive:
            print(f"    {a} / {name}: " + median_line([x / f for x, f in zip(tps[a], tps[name], strict=True)]))
            if f"{name} again" in tps:  # against the mean of both runs: half the reference's own noise
                ratios = [x / ((f + g) / 2) for x, f, g in zip(tps[a], tps[name], tps[f"{name} again"], strict=True)]
                print(f"    {a} / {name} (both runs): " + median_line(ratios))


if __name__ == "__main__":
    main()
