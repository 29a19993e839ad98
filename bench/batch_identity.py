"""Batched vs solo greedy decoding on this device: identical tokens? and what a batch step costs.

    python bench/batch_identity.py [MODEL] [--sizes 1 8 32] [--max-tokens 64]

For each batch size B, B distinct prompts decode together through the engine's BatchDecoder (greedy,
EOS ignored so every sequence runs its whole budget); each sequence is compared token for token with
its solo plain decoding (Engine.complete, native MTP off). Prints per B: sequences identical to solo,
the first diverging position of the others, the mean decode step time, and the aggregate decode
tokens/s (prefill excluded) against solo decoding's tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import mlx.core as mx

from exo.engine import GenerationRequest, load
from exo.engine.batch import BatchDecoder
from exo.engine.costs import device_name

SUBJECTS = ("the sea", "a lighthouse", "autumn", "a cat", "the moon", "a city", "rain", "mountains")
FORMS = ("Write a poem about {}.", "def describe_{}():", "Tell me a story about {}", "Facts about {}:")


def prompts(engine, n: int) -> list[list[int]]:
    texts = [f.format(s) for f in FORMS for s in SUBJECTS]
    return [engine.loaded.tokenizer.encode(texts[i % len(texts)] + " " * (i // len(texts))) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    n = max(args.sizes)
    ids = prompts(engine, n)
    solo, solo_s = [], 0.0
    for p in ids:
        result = engine.complete(GenerationRequest(p, max_tokens=args.max_tokens, native_mtp="off"))
        solo.append(result.token_ids)
        solo_s += (args.max_tokens - 1) / max(result.stats.decode_tokens_per_s, 1e-9)
    print(f"{args.model} on {device_name()}, {args.max_tokens} tokens per sequence, greedy")
    print(f"solo plain decoding: {n * (args.max_tokens - 1) / solo_s:.1f} tok/s (mean over {n} prompts)")
    for size in args.sizes:
        batch = BatchDecoder(engine)
        tokens: dict[int, list[int]] = {}
        runs = []
        for i in range(size):
            run = engine.start(GenerationRequest(ids[i], max_tokens=args.max_tokens))
            tokens[id(run)] = [t for chunk in run.begin() if chunk is not None for t in chunk.token_ids]
            batch.add(run)
            runs.append(run)
        mx.eval([c.state for c in batch.cache])
        start = time.perf_counter()
        steps = 0
        while len(batch):
            for run, chunks in batch.step():
                for chunk in chunks:
                    tokens[id(run)].extend(chunk.token_ids)
            steps += 1
        elapsed = time.perf_counter() - start
        same, first = 0, []
        for i, run in enumerate(runs):
            got = tokens[id(run)]
            if got == solo[i]:
                same += 1
            else:
                first.append(next((j for j, (a, b) in enumerate(zip(got, solo[i], strict=False)) if a != b), len(got)))
        print(
            f"B={size:3d}: identical to solo {same}/{size}"
            + (f" (first differences at {sorted(first)})" if first else "")
            + f"; step {elapsed / steps * 1000:.2f} ms; {size * (args.max_tokens - 1) / elapsed:.1f} tok/s aggregate"
        )


if __name__ == "__main__":
    main()
