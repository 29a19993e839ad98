"""Adaptive depth against fixed depths, strictly alternating: the pairs ``exo bench`` cannot isolate.

    python bench/adaptive_vs_fixed.py [MODEL] [--max-tokens 160] [--repeats 6] [--depths 0 1 2 3] [--control]
        [--raw-timings] [--tracker NAME=VALUE ...]

For each repeat and each of ``exo bench``'s prompts, greedy, EOS ignored: adaptive depth, then every fixed
depth in ``--depths`` (0: plain decoding), the order of the whole group rotated by one each time. Adaptive
keeps the engine's one policy across requests, as a server does. Prints the median tokens/s of each (first
to last token), adaptive's depth histogram, and the median and quartiles of the ratios adaptive / fixed K
over requests of the same prompt run seconds apart: on a shared machine whose speed drifts, a bench that
runs five configurations a prompt compares moments a minute apart, these compare neighbours.

``--control`` runs every fixed depth a second time in each group ("plain again", "k=3 again", in the rotated
order like the rest) and prints the same median ratio between the two runs of one configuration: the metric's
own noise floor on this host, in the same run (on H200s whose speed swings within seconds, two runs of one
fixed depth read 0.976-1.008x each other over 48-80 groups).

``--raw-timings`` adds "adaptive raw": a second engine on the same checkpoint whose adaptive policy keeps raw
seconds per depth and probes single rounds from K = 0 (``DepthPolicy.track_drift`` and ``explore_deeper``
off: the policy as it was before either).

``--control`` also prints adaptive over the mean of a fixed depth's two runs in its group ("both runs"): a
reference with half the noise of either run.

``--tracker idle_forget=1 revert_weight=0`` adds "adaptive variant": another engine on the same checkpoint whose
policy's acceptance tracker has those fields set (``AcceptanceTracker``; these two: the tracker before its
estimates reverted to the long-run rate): two settings of the tracker judged request by request in one run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import statistics
import sys

from exo.engine import GenerationRequest, SamplingParams, load
from exo.engine.adaptive import TRACE_ENV, DepthPolicy
from exo.engine.bench import DEFAULT_PROMPTS, encode_prompt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--control", action="store_true", help="each fixed depth twice a group: the noise floor")
    parser.add_argument("--raw-timings", action="store_true")
    parser.add_argument("--tracker", nargs="*", default=[], metavar="NAME=VALUE",
                        help="an 'adaptive variant' engine whose acceptance tracker has these fields")
    args = parser.parse_args()
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
        if trace:  # its policy traces to a file of its own: FILE.raw, FILE.variant
            os.environ[TRACE_ENV] = f"{trace}.{name.split()[-1]}"
        policy = other._adaptive_policy()
        if trace:
            os.environ[TRACE_ENV] = trace
        engines[name] = other
        configs.insert(1, (name, None))
        return policy

    if args.raw_timings:
        policy = second_engine("adaptive raw")
        policy.track_drift = policy.explore_deeper = False
    if args.tracker:
        tracker = second_engine("adaptive variant").tracker
        for item in args.tracker:
            name, value = item.split("=")
            setattr(tracker, name, type(getattr(tracker, name))(value))
    histogram: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)

    def run(name: str, prompt: list[int], k: int | None, max_tokens: int) -> float:
        request = GenerationRequest(
            prompt, max_tokens=max_tokens, sampling=SamplingParams(temperature=0),
            native_mtp="off" if k == 0 else "on", mtp_k=None if k in (None, 0) else k,
        )
        stats = engines[name].complete(request).stats
        if k is None and max_tokens == args.max_tokens:
            histogram[name].update(stats.k_histogram)  # rounds per depth (K = 0: plain tokens)
        return stats.decode_tokens_per_s

    longest = max(prompts, key=len)
    for name, k in configs:  # warm-up: every path compiled once over a whole request (adaptive: a short one)
        run(name, longest, k, 16 if k is None else args.max_tokens)
    tps: dict[str, list[float]] = {name: [] for name, _ in configs}
    turn = 0
    for _ in range(args.repeats):
        for prompt in prompts:
            order = configs[turn % len(configs):] + configs[: turn % len(configs)]
            turn += 1
            for name, k in order:
                tps[name].append(run(name, prompt, k, args.max_tokens))
            print(f"group {turn}: " + ", ".join(f"{name} {v[-1]:.1f}" for name, v in tps.items()), file=sys.stderr,
                  flush=True)  # as it goes: a run cut short still says something
    print(f"{args.model} on {engine.costs().device}: {len(tps['adaptive'])} groups of {args.max_tokens} tokens; "
          "median tokens/s " + ", ".join(f"{name} {statistics.median(v):.1f}" for name, v in tps.items()))
    for name, counts in histogram.items():
        print(f"  {name}: rounds per depth (K = 0: plain tokens) {dict(sorted(counts.items()))}")
    adaptive = [name for name, k in configs if k is None]
    for a in adaptive[1:]:
        ratios = [x / y for x, y in zip(tps[a], tps["adaptive"], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios)
        print(f"  {a} / adaptive: median {statistics.median(ratios):.3f} (quartiles {q1:.3f} / {q3:.3f})")
    for name, k in configs:
        if k is None or name.endswith(" again"):
            continue
        if f"{name} again" in tps:
            ratios = [x / f for x, f in zip(tps[f"{name} again"], tps[name], strict=True)]
            q1, _, q3 = statistics.quantiles(ratios)
            print(f"  {name} again / {name} (the noise floor): median {statistics.median(ratios):.3f} "
                  f"(quartiles {q1:.3f} / {q3:.3f})")
        if "plain" in tps and name != "plain":
            ratios = [f / p for f, p in zip(tps[name], tps["plain"], strict=True)]
            print(f"  {name} / plain: median {statistics.median(ratios):.3f}")
        for a in adaptive:
            ratios = [x / f for x, f in zip(tps[a], tps[name], strict=True)]
            q1, _, q3 = statistics.quantiles(ratios)
            print(f"    {a} / {name}: median {statistics.median(ratios):.3f} (quartiles {q1:.3f} / {q3:.3f})")
            if f"{name} again" in tps:  # against the mean of both runs: half the reference's own noise
                ratios = [x / ((f + g) / 2) for x, f, g in zip(tps[a], tps[name], tps[f"{name} again"], strict=True)]
                q1, _, q3 = statistics.quantiles(ratios)
                print(f"    {a} / {name} (both runs): median {statistics.median(ratios):.3f} "
                      f"(quartiles {q1:.3f} / {q3:.3f})")


if __name__ == "__main__":
    main()
