"""The engine against stock mlx-lm: exo's plain decoding vs ``mlx_lm.stream_generate``, strictly alternating.

    python bench/engine.py [MODEL] [--max-tokens 128] [--repeats 6] [--device cpu|gpu] [--compiled-layers] [--json]

(``exo bench MODEL --baseline`` adds native MTP at every depth and adaptive to the same comparison.)

For each repeat and each of ``exo bench``'s prompts: stock mlx-lm (its own model classes on the same
checkpoint directory), then exo's rows in an order that rotates from prompt to prompt: exo plain decoding, exo plain
decoding on MLX's ops: its GatedDeltaNet rows
uncompiled and off exo's step kernel, its quantized products MLX's (``EXO_GDN_COMPILED=0``, ``EXO_GDN_KERNEL=0``,
``EXO_QGEMV=0``: ops as stock runs them; the same on devices other than CUDA), EOS ignored. The header says which
of exo's own kernels loaded (their load-time checks; on MLX CUDA only). Prints the median tokens/s of each (first to
last token) and the median and quartiles of the per-pair ratios exo / stock: on a host whose speed drifts
(an H100 host went from 119 to 66 tokens/s within one run), pairs run seconds apart are what compare.

``--compiled-layers``: a fourth row, exo with its decoder layers as compiled calls (``models.compiled_layers``, as
``EXO_COMPILED_LAYERS=always``), its ratios to stock and to exo's op-by-op row, and whether its greedy tokens were
op by op's for every request.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from common import add_common_arguments, report_to, use_device  # bench/ is this script's folder

from exo.engine import GenerationRequest, SamplingParams, load
from exo.engine.bench import DEFAULT_PROMPTS, StockMLXLM, encode_prompt
from exo.engine.costs import device_name
from exo.engine.models import compiled_layers, layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--compiled-layers", action="store_true",
                        help="also exo with its decoder layers as compiled calls (EXO_COMPILED_LAYERS=always)")
    args = parser.parse_args()
    with report_to(args.json) as report:
        run(args, report)


def run(args: argparse.Namespace, report: dict) -> None:
    use_device(args.device)
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    stock = StockMLXLM(engine.loaded.path)
    prompts = [encode_prompt(engine, p, True) for p in DEFAULT_PROMPTS]
    compiled = layers.COMPILED_ROWS
    print("exo's own kernels: " + ("; ".join(f"{k}: {v}" for k, v in {**engine.loaded.qgemv, **engine.loaded.padded, **engine.loaded.gdn}.items())
                                  or "none"))

    compiled_mode = compiled_layers.MODE
    tokens: dict[str, list[list[int]]] = {"exo": [], "exo, compiled layers": []}

    def exo(prompt: list[int], own: bool = True, compiled_steps: bool = False) -> float:
        request = GenerationRequest(prompt, max_tokens=args.max_tokens, sampling=SamplingParams(temperature=0),
                                    native_mtp="off")
        layers.COMPILED_ROWS = compiled if own else "off"
        layers.QGEMV_ON = layers.GDN_KERNEL_ON = own
        compiled_layers.MODE = "always" if compiled_steps else "off"
        try:
            result = engine.complete(request)
            if own:
                tokens["exo, compiled layers" if compiled_steps else "exo"].append(result.token_ids)
            return result.stats.decode_tokens_per_s
        finally:
            layers.COMPILED_ROWS, layers.QGEMV_ON, layers.GDN_KERNEL_ON = compiled, True, True
            compiled_layers.MODE = compiled_mode

    for prompt in prompts[:2]:  # warm-up: every path compiled once
        exo(prompt), exo(prompt, False), stock.decode(prompt, args.max_tokens, 0.0)
        if args.compiled_layers:
            exo(prompt, compiled_steps=True)
    for found in tokens.values():
        found.clear()
    tps: dict[str, list[float]] = {"stock": [], "exo": [], "exo, MLX's ops": []}
    if args.compiled_layers:
        tps["exo, compiled layers"] = []
    runs = {"exo": lambda p: exo(p), "exo, MLX's ops": lambda p: exo(p, False),
            "exo, compiled layers": lambda p: exo(p, compiled_steps=True)}
    turn = 0
    for _ in range(args.repeats):
        for prompt in prompts:
            tps["stock"].append(stock.decode(prompt, args.max_tokens, 0.0)[0])
            # exo's rows in a rotating order after stock's (the one right after stock ran measurably slower on a
            # CPU: an order effect, not a row's own speed)
            names = [name for name in tps if name != "stock"]
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                tps[name].append(runs[name](prompt))
            turn += 1
    print(f"{args.model}: {len(tps['stock'])} pairs of {args.max_tokens} tokens; median tokens/s "
          + ", ".join(f"{name} {statistics.median(v):.1f}" for name, v in tps.items()))
    report.update(model=args.model, device=device_name(), max_tokens=args.max_tokens, pairs=len(tps["stock"]),
                  median_tokens_per_s={name: statistics.median(v) for name, v in tps.items()}, vs_stock={})
    for name in [n for n in tps if n != "stock"]:
        ratios = [e / s for e, s in zip(tps[name], tps["stock"], strict=True)]
        q1, _, q3 = statistics.quantiles(ratios) if len(ratios) > 1 else (ratios[0],) * 3
        report["vs_stock"][name] = {"median": statistics.median(ratios), "quartiles": [q1, q3]}
        print(f"  {name} / stock: median {statistics.median(ratios):.3f} (quartiles {q1:.3f} / {q3:.3f})")
    if args.compiled_layers:
        ratios = [c / e for c, e in zip(tps["exo, compiled layers"], tps["exo"], strict=True)]
        same = sum(a == b for a, b in zip(tokens["exo, compiled layers"], tokens["exo"], strict=True))
        report["compiled_vs_exo"] = {"median": statistics.median(ratios), "same_tokens": same, "requests": len(ratios)}
        print(f"  exo, compiled layers / exo: median {statistics.median(ratios):.3f}; greedy tokens op by op's in "
              f"{same} of {len(ratios)} requests")

if __name__ == "__main__":
    main()
