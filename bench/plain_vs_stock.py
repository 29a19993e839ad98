"""Plain decoding, strictly alternating with stock mlx-lm: exo's engine vs ``mlx_lm.stream_generate``.

    python bench/plain_vs_stock.py [MODEL] [--max-tokens 128] [--repeats 6]

For each repeat and each of ``exo bench``'s prompts: stock mlx-lm (its own model classes on the same
checkpoint directory), then exo plain decoding, then exo plain decoding with its GatedDeltaNet rows
uncompiled (``EXO_GDN_COMPILED=0``: ops as stock runs them; the same on devices other than CUDA), EOS ignored. Prints the median tokens/s of each (first to
last token) and the median and quartiles of the per-pair ratios exo / stock: on a host whose speed drifts
(an H100 host went from 119 to 66 tokens/s within one run), pairs run seconds apart are what compare.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from exo.engine import GenerationRequest, SamplingParams, load
from exo.engine.bench import DEFAULT_PROMPTS, StockMLXLM, encode_prompt
from exo.engine.models import layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    stock = StockMLXLM(engine.loaded.path)
    prompts = [encode_prompt(engine, p, True) for p in DEFAULT_PROMPTS]
    compiled = layers.COMPILED_ROWS

    def exo(prompt: list[int], gdn: str = compiled) -> float:
        request = GenerationRequest(prompt, max_tokens=args.max_tokens, sampling=SamplingParams(temperature=0),
                                    native_mtp="off")
        layers.COMPILED_ROWS = gdn
        try:
            return engine.complete(request).stats.decode_tokens_per_s
        finally:
            layers.COMPILED_ROWS = compiled

    for prompt in prompts[:2]:  # warm-up: every path compiled once
        exo(prompt), exo(prompt, "off"), stock.decode(prompt, args.max_tokens, 0.0)
    tps: dict[str, list[float]] = {"stock": [], "exo": [], "exo, GDN uncompiled": []}
    for _ in range(args.repeats):
        for prompt in prompts:
            tps["stock"].append(stock.decode(prompt, args.max_tokens, 0.0)[0])
            tps["exo"].append(exo(prompt))
            tps["exo, GDN uncompiled"].append(exo(prompt, "off"))
    print(f"{args.model}: {len(tps['stock'])} pairs of {args.max_tokens} tokens; median tokens/s "
          + ", ".join(f"{name} {statistics.median(v):.1f}" for name, v in tps.items()))
    for name in ("exo", "exo, GDN uncompiled"):
        ratios = [e / s for e, s in zip(tps[name], tps["stock"], strict=True)]
        q1, q2, q3 = statistics.quantiles(ratios)
        print(f"  {name} / stock: median {statistics.median(ratios):.3f} (quartiles {q1:.3f} / {q3:.3f})")


if __name__ == "__main__":
    main()
