"""A solo request's decode speed against another commit's: plain decoding and each fixed depth, alternating.

    python bench/batch_of_one.py --baseline REV [MODEL] [--max-tokens 128] [--repeats 4] [--device cpu|gpu] [--json]

A solo request decodes as a batch of one (``engine.batch.BatchDecoder``); before, it ran a solo loop of its
own. This runs ``Engine.complete`` (greedy, EOS ignored) at K = 0 (``native_mtp="off"``) and each fixed
``mtp_k`` in worker processes that alternate between this checkout's ``src`` and ``REV``'s (``git archive``),
each worker timing every configuration on ``exo bench``'s prompts, and prints per configuration the median
tokens/s of each side and the median and quartiles of the per-pair ratios (this / baseline): workers run
seconds apart, so a shared machine's slow moments hit both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from common import SRC, add_common_arguments, report_to  # bench/ is this script's folder

CONFIGS = {"plain": {"native_mtp": "off"}, "K=1": {"mtp_k": 1}, "K=2": {"mtp_k": 2}, "K=3": {"mtp_k": 3}}


def worker(args: argparse.Namespace) -> None:
    import dataclasses

    from common import use_device

    from exo.engine import GenerationRequest, SamplingParams, load
    from exo.engine.bench import DEFAULT_PROMPTS, encode_prompt

    use_device(args.device)
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    prompts = [encode_prompt(engine, p, True) for p in DEFAULT_PROMPTS]

    def tps(prompt: list[int], fields: dict) -> float:
        request = GenerationRequest(prompt, max_tokens=args.max_tokens, sampling=SamplingParams(temperature=0),
                                    **fields)
        return engine.complete(request).stats.decode_tokens_per_s

    for fields in CONFIGS.values():  # warm-up: every path compiled once
        tps(prompts[0], fields)
    out: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for prompt in prompts:
        for name, fields in CONFIGS.items():
            out[name].append(tps(prompt, fields))
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=4)
    parser.add_argument("--baseline", help="the commit to compare with (a git revision; required)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.baseline:
        parser.error("--baseline REV is required")
    with report_to(args.json) as report, tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "baseline.tar"
        subprocess.run(["git", "-C", str(SRC.parent), "archive", "-o", str(archive), args.baseline, "src", "model_cards"], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        sides = {"this": str(SRC), "baseline": str(Path(tmp) / "src")}
        runs: dict[str, list[dict[str, list[float]]]] = {side: [] for side in sides}
        command = [sys.executable, __file__, "--worker", args.model, "--max-tokens", str(args.max_tokens)]
        if args.device:
            command += ["--device", args.device]
        for repeat in range(args.repeats):
            order = list(sides) if repeat % 2 == 0 else list(sides)[::-1]
            for side in order:
                env = dict(os.environ, PYTHONPATH=sides[side])
                done = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
                runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
        report["baseline"] = args.baseline
        report["max_tokens"] = args.max_tokens
        for name in CONFIGS:
            this = [v for run in runs["this"] for v in run[name]]
            base = [v for run in runs["baseline"] for v in run[name]]
            ratios = sorted(a / b for a, b in zip(this, base, strict=True) if b > 0)
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            report[name] = {"this_tps": statistics.median(this), "baseline_tps": statistics.median(base),
                            "ratio_median": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
                            "this_best_tps": max(this), "baseline_best_tps": max(base)}
            # The best of each side: the least disturbed by other work on a shared machine.
            print(f"{name:6s} this {statistics.median(this):8.2f} tok/s  baseline {statistics.median(base):8.2f} "
                  f"tok/s  ratio {statistics.median(ratios):.3f} [{q[0]:.3f}, {q[2]:.3f}]  best {max(this):.2f} "
                  f"vs {max(base):.2f} ({max(this) / max(base):.3f})", file=sys.stderr)


if __name__ == "__main__":
    main()
