"""A solo request's decode speed against another commit's: plain decoding, each fixed depth and adaptive depth.

    python bench/batch_of_one.py --baseline REV [MODEL] [--max-tokens 128] [--repeats 4] [--device cpu|gpu]
                                 [--in-process] [--json]

Runs ``Engine.complete`` (greedy, EOS ignored) at K = 0 (``native_mtp="off"``), each fixed ``mtp_k`` and
adaptive depth on ``exo bench``'s prompts, this checkout's engine against ``REV``'s (``git archive``), and
prints per configuration the median tokens/s of each side and the median and quartiles of the per-pair
ratios (this / baseline).

Across processes (the default): worker processes alternate between the two sides, each timing every
configuration; workers run seconds apart, so a shared machine's slow moments hit the sides unevenly.
``--in-process``: both engines in one process (the baseline's package imported as ``exo_base``, its model
loaded by its own code), every configuration's pair run back to back in alternating order and its tokens
asserted equal: the pairs are milliseconds apart, the measurement a refactor of the decode loop wants.
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

CONFIGS = {"plain": {"native_mtp": "off"}, "K=1": {"mtp_k": 1}, "K=2": {"mtp_k": 2}, "K=3": {"mtp_k": 3},
           "adaptive": {}}


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
    parser.add_argument("--in-process", action="store_true",
                        help="both engines in this process, pairs back to back (see the module's doc)")
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
        if args.in_process:
            in_process(args, Path(tmp), report)
            return
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
        summarize(args, report, {name: [v for run in runs["this"] for v in run[name]] for name in CONFIGS},
                  {name: [v for run in runs["baseline"] for v in run[name]] for name in CONFIGS})


def in_process(args: argparse.Namespace, tmp: Path, report: dict) -> None:
    """Both sides in this process: the baseline's ``src/exo`` copied as the package ``exo_base`` (its absolute
    imports of ``exo`` rewritten), each side's model loaded by its own code (their cache classes differ)."""
    import dataclasses
    import importlib
    import re
    import shutil

    from common import use_device

    from exo.engine import GenerationRequest, SamplingParams, load
    from exo.engine.bench import DEFAULT_PROMPTS, encode_prompt

    base = tmp / "pkg" / "exo_base"
    shutil.copytree(tmp / "src" / "exo", base)
    for path in base.rglob("*.py"):
        text = path.read_text()
        path.write_text(re.sub(r"\b(from|import) exo\b", r"\1 exo_base", text))
    sys.path.insert(0, str(tmp / "pkg"))
    base_engine = importlib.import_module("exo_base.engine")
    base_request = importlib.import_module("exo_base.engine").GenerationRequest
    base_sampling = importlib.import_module("exo_base.engine").SamplingParams
    use_device(args.device)
    sides = {"this": load(args.model), "baseline": base_engine.load(args.model)}
    for engine in sides.values():
        engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    prompts = [encode_prompt(sides["this"], p, True) for p in DEFAULT_PROMPTS]

    def run(side: str, prompt: list[int], fields: dict) -> tuple[float, list[int]]:
        request, sampling = (GenerationRequest, SamplingParams) if side == "this" else (base_request, base_sampling)
        result = sides[side].complete(request(prompt, max_tokens=args.max_tokens, sampling=sampling(temperature=0),
                                              **fields))
        return result.stats.decode_tokens_per_s, result.token_ids

    for fields in CONFIGS.values():  # warm-up: every path compiled once, adaptive depth's costs measured
        for side in sides:
            run(side, prompts[0], fields)
    this: dict[str, list[float]] = {name: [] for name in CONFIGS}
    baseline: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for repeat in range(args.repeats):
        for prompt in prompts:
            for name, fields in CONFIGS.items():
                order = ["this", "baseline"] if repeat % 2 == 0 else ["baseline", "this"]
                got = {side: run(side, prompt, fields) for side in order}
                if got["this"][1] != got["baseline"][1]:
                    raise SystemExit(f"{name}: the two sides' tokens differ")
                this[name].append(got["this"][0])
                baseline[name].append(got["baseline"][0])
    report["in_process"] = True
    summarize(args, report, this, baseline)


def summarize(args: argparse.Namespace, report: dict, this_tps: dict[str, list[float]],
              baseline_tps: dict[str, list[float]]) -> None:
    report["baseline"] = args.baseline
    report["max_tokens"] = args.max_tokens
    for name in CONFIGS:
        this, base = this_tps[name], baseline_tps[name]
        ratios = sorted(a / b for a, b in zip(this, base, strict=True) if b > 0)
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        report[name] = {"this_tps": statistics.median(this), "baseline_tps": statistics.median(base),
                        "ratio_median": statistics.median(ratios), "ratio_q1": q[0], "ratio_q3": q[2],
                        "this_best_tps": max(this), "baseline_best_tps": max(base)}
        # The best of each side: the least disturbed by other work on a shared machine.
        print(f"{name:8s} this {statistics.median(this):8.2f} tok/s  baseline {statistics.median(base):8.2f} "
              f"tok/s  ratio {statistics.median(ratios):.3f} [{q[0]:.3f}, {q[2]:.3f}]  best {max(this):.2f} "
              f"vs {max(base):.2f} ({max(this) / max(base):.3f})", file=sys.stderr)


if __name__ == "__main__":
    main()
