"""Pipeline benchmark: tokens/s of one node vs 2- and 3-stage pipelines over loopback, MTP off and on.

    python bench/pipeline.py [MODEL] [--stages 1,2,3] [--max-tokens 128] [--repeats 3] [--json] [--gpu-per-stage]

Every configuration runs in fresh processes (one per stage, a ring over 127.0.0.1, exactly what a
cluster's runners run: exo.runner.local_pipeline), the same prompts, greedy, EOS ignored so every
generation is max-tokens long. Repeats alternate the configurations, so a slow moment of the machine
hits all of them. Prints decode tokens/s (median over prompts and repeats) per stage count and mode, the
ratio to one node in the same mode, acceptance, and what crosses a stage boundary (the leader's bytes,
both ways) per round and per emitted token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from exo.engine import load_checkpoint, resolve_model
from exo.runner.local_pipeline import run_local_pipeline

MODES = {"plain": {"native_mtp": "off"}, "k1": {"mtp_k": 1}, "k2": {"mtp_k": 2}, "k3": {"mtp_k": 3},
         "adaptive": {}}
PROMPTS = ("def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n")


def split(n_layers: int, stages: int) -> list[tuple[int, int]]:
    base, extra = divmod(n_layers, stages)
    out, start = [], 0
    for rank in range(stages):
        end = start + base + (1 if rank < extra else 0)
        out.append((start, end))
        start = end
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None, help="card id, repo or directory (default: exo-demo)")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--modes", default="plain,k1,k2,adaptive")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.add_argument("--gpu-per-stage", action="store_true",
                   help="on a host with several CUDA GPUs: stage i on GPU i (CUDA_VISIBLE_DEVICES), as separate nodes")
    args = p.parse_args(argv)
    resolved = resolve_model(args.model)
    loaded = load_checkpoint(resolved.path)
    n_layers = loaded.model.num_layers
    tokenizer = loaded.tokenizer
    stage_counts = [int(s) for s in args.stages.split(",")]
    modes = args.modes.split(",")
    requests, keys = [], []
    for mode in modes:
        for prompt in PROMPTS:
            requests.append({"prompt": tokenizer.encode(prompt), "max_tokens": args.max_tokens, "ignore_eos": True,
                             **MODES[mode]})
            keys.append(mode)
    rows: dict[tuple[int, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for stages in stage_counts:
            env = [{"CUDA_VISIBLE_DEVICES": str(rank)} for rank in range(stages)] if args.gpu_per_stage else None
            out = run_local_pipeline(resolved.path, split(n_layers, stages), requests, warmup=True, stage_env=env)
            for mode, result in zip(keys, out["results"], strict=True):
                rows.setdefault((stages, mode), []).append(result)
            done = {mode: statistics.median(r["stats"]["decode_tokens_per_s"] for r in rows[(stages, mode)][-len(PROMPTS):])
                    for mode in modes}
            print(f"repeat {repeat + 1}/{args.repeats}: {stages} stage(s) done (tok/s: "
                  + ", ".join(f"{mode} {tps:.1f}" for mode, tps in done.items()) + ")", file=sys.stderr, flush=True)
    report = []
    for stages in stage_counts:
        for mode in modes:
            results = rows[(stages, mode)]
            tps = statistics.median(r["stats"]["decode_tokens_per_s"] for r in results)
            base = statistics.median(r["stats"]["decode_tokens_per_s"] for r in rows[(stage_counts[0], mode)])
            drafted = sum(r["stats"]["drafted_tokens"] for r in results)
            accepted = sum(r["stats"]["accepted_tokens"] for r in results)
            steps = sum(sum(r["stats"]["k_histogram"].values()) for r in results)  # rounds + plain steps
            tokens = sum(len(r["token_ids"]) for r in results)
            moved = sum(r["bytes_sent"] + r["bytes_received"] for r in results)
            report.append({
                "stages": stages, "mode": mode, "decode_tokens_per_s": round(tps, 2),
                "vs_first": round(tps / base, 3) if base else None,
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "bytes_per_round": round(moved / steps) if stages > 1 and steps else 0,
                "bytes_per_token": round(moved / tokens) if stages > 1 and tokens else 0,
            })
    if args.json:
        print(json.dumps({"model": resolved.model_id, "n_layers": n_layers, "max_tokens": args.max_tokens,
                          "repeats": args.repeats, "rows": report}, indent=1))
        return 0
    print(f"{resolved.model_id} ({n_layers} layers), {args.max_tokens} tokens x {len(PROMPTS)} prompts x "
          f"{args.repeats} repeats; ratio vs {stage_counts[0]} stage(s) in the same mode")
    print(f"{'stages':>6} {'mode':>9} {'tok/s':>8} {'ratio':>6} {'accept':>7} {'B/round':>8} {'B/token':>8}")
    for row in report:
        print(f"{row['stages']:>6} {row['mode']:>9} {row['decode_tokens_per_s']:>8.2f} {row['vs_first'] or 0:>6.3f} "
              f"{row['acceptance'] if row['acceptance'] is not None else '-':>7} {row['bytes_per_round']:>8} "
              f"{row['bytes_per_token']:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
