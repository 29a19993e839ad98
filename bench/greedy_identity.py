"""How often greedy MTP output is token-identical to plain greedy decoding on this device.

    python bench/greedy_identity.py [MODEL ...] [--runs 12] [--max-tokens 192] [--device cpu|gpu] [--json]

Each run is one prompt (a different one per run), decoded plainly and with native MTP at K = 1, 2, 3 and
adaptive, EOS ignored. On the CPU identity is exact by construction (the test suite asserts it); GPU
kernels may round a multi-row verify call differently from a one-row decode step, which this measures.
The report names what the engine's verify probe computes row by row on this device (engine/verify.py).

    python bench/greedy_identity.py MODEL --cost [--repeats 3]

also times MTP at K = 1..3 with the probe's per-row linear layers on and off (interleaved, one process),
and how often each is identical: what exactness costs where a device's matmul rounds by row count.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from common import use_device  # bench/ is this script's folder

from exo.engine import GenerationRequest, load
from exo.engine.costs import device_name

PROMPTS = (
    "def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv=None):\n", "for i in range(10):\n", "def read_file(path):\n    with open(",
    "# Sort a list of numbers\n", "async def fetch(session, url):\n", "class Node:\n    def __init__(self, value):\n",
    "def main():\n    args = ", "import json\n\ndef load_config(path):\n", "while True:\n    line = ",
    "def quicksort(items):\n", "from dataclasses import dataclass\n\n@dataclass\nclass Point:\n",
    "def is_prime(n):\n", "with open('data.csv') as f:\n",
)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="*", default=[None])
    p.add_argument("--runs", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--json", action="store_true")
    p.add_argument("--cost", action="store_true", help="time K = 1..3 with per-row linears on and off")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", choices=("cpu", "gpu"), default=None, help="MLX's device (default: MLX's default)")
    args = p.parse_args(argv)
    use_device(args.device)
    report = {"device": device_name(), "runs": args.runs, "max_tokens": args.max_tokens, "models": {}}
    for model in args.models:
        engine = load(model)
        engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
        tokenizer = engine.loaded.tokenizer
        mode = engine.verify_mode
        rowwise = [name for name, same in engine.verify_probe.items() if not same]
        print(f"{engine.loaded.model_id}: verify mode {mode}; differs by row count: {rowwise or 'nothing'}", flush=True)
        same = {"k1": 0, "k2": 0, "k3": 0, "adaptive": 0}
        first_divergence: dict[str, list[int]] = {name: [] for name in same}
        for run in range(args.runs):
            prompt = tokenizer.encode(PROMPTS[run % len(PROMPTS)])
            plain = engine.complete(GenerationRequest(prompt, max_tokens=args.max_tokens, native_mtp="off")).token_ids
            for name, k in (("k1", 1), ("k2", 2), ("k3", 3), ("adaptive", None)):
                out = engine.complete(GenerationRequest(prompt, max_tokens=args.max_tokens, mtp_k=k)).token_ids
                if out == plain:
                    same[name] += 1
                else:
                    first_divergence[name].append(next(i for i, (a, b) in enumerate(zip(out, plain, strict=True)) if a != b))
        report["models"][engine.loaded.model_id] = {
            "identical": {name: f"{count}/{args.runs}" for name, count in same.items()},
            "first_divergence": first_divergence,
            "verify_mode": str(mode),
            "per_row": rowwise,
        }
        if args.cost:
            report["models"][engine.loaded.model_id]["cost"] = _cost(engine, tokenizer, args)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"{report['device']}: {args.runs} runs x {args.max_tokens} tokens, greedy MTP identical to plain")
        for model, row in report["models"].items():
            print(f"  {model}: " + "  ".join(f"{k} {v}" for k, v in row["identical"].items()))
    return report


def _cost(engine, tokenizer, args) -> dict:
    """tok/s of plain and K = 1..3 with the per-row linears on and off, interleaved; identity of each."""
    model = engine.model
    linears = model.__dict__.get("_rowwise_linears", ())
    prompts = [tokenizer.encode(p) for p in PROMPTS[: args.repeats]]
    plains = [engine.complete(GenerationRequest(p, max_tokens=args.max_tokens, native_mtp="off")).token_ids for p in prompts]
    rates: dict[str, list[float]] = {}
    same: dict[str, int] = {}
    for i, prompt in enumerate(prompts):
        for name, k, on in [("plain", None, True)] + [(f"k{k} {w}", k, w == "per-row") for k in (1, 2, 3)
                                                       for w in ("per-row", "batched")]:
            object.__setattr__(model, "_rowwise_linears", linears if on else ())
            request = GenerationRequest(prompt, max_tokens=args.max_tokens, native_mtp="off" if k is None else "on",
                                        mtp_k=k)
            start = time.perf_counter()
            out = engine.complete(request)
            rates.setdefault(name, []).append(len(out.token_ids) / (time.perf_counter() - start))
            same[name] = same.get(name, 0) + (out.token_ids == plains[i])
    object.__setattr__(model, "_rowwise_linears", linears)
    plain = statistics.median(rates["plain"])
    rows = {name: {"tok_s": round(statistics.median(r), 1), "vs_plain": round(statistics.median(r) / plain, 3),
                   "identical": f"{same[name]}/{len(prompts)}"} for name, r in rates.items()}
    for name, row in rows.items():
        print(f"  {name:14s} {row['tok_s']:8.1f} tok/s  {row['vs_plain']:.3f}x plain  identical {row['identical']}",
              flush=True)
    return rows


if __name__ == "__main__":
    main()
