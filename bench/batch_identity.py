"""Batched vs solo greedy decoding on this device: identical tokens? and what a batch step costs.

    python bench/batch_identity.py [MODEL] [--sizes 1 8 32] [--max-tokens 64] [--mtp [--ks 1 2 3]] [--vectors] [--invariant]

For each batch size B, B distinct prompts decode together through the engine's BatchDecoder (greedy,
EOS ignored so every sequence runs its whole budget); each sequence is compared token for token with
its solo plain decoding (Engine.complete, native MTP off). Prints per B: sequences identical to solo,
the first diverging position of the others, the mean decode step time, and the aggregate decode
tokens/s (prefill excluded) against solo decoding's tokens/s.

``--mtp``: each batch size also runs with native MTP in the batch, at each forced depth of ``--ks`` and
adaptive: per run the same identity check, the mean round time and its cost in batched plain steps of the
same B (what adaptive depth weighs: beta + delta of a batched round), the tokens a member gains per round,
and the aggregate tokens/s against the batched plain run's.
``--invariant``: each batch size also decodes plainly with the engine's batch-invariant steps
(``EngineConfig.batch_invariant``: linear rows as one-row products, attention per sequence over its own
unpadded keys, experts unsorted): identity to solo of two runs and the step time against the default batched step
(with ``--mtp``, also the identity of each forced depth in that mode).

``--vectors``: each batch size also decodes plainly with a batch-invariant candidate path: every bias-free
linear layer of the backbone and the lm_head compute each sequence's row as its own matrix-vector product
(``models.layers.vector_matmul``, one call per layer: what a one-row decode step computes), the rest of the
step as batched. Prints its identity to solo and its step time against the default batched step: the cost
of that path (issue 17 asks whether a batch-invariant path costs under 10%).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import mlx.core as mx
from batch_ops import _BatchVectors, batch_vectors  # bench/ is this script's folder

from exo.engine import GenerationRequest, load
from exo.engine.batch import BatchDecoder
from exo.engine.costs import device_name

SUBJECTS = ("the sea", "a lighthouse", "autumn", "a cat", "the moon", "a city", "rain", "mountains")
FORMS = ("Write a poem about {}.", "def describe_{}():", "Tell me a story about {}", "Facts about {}:")


def prompts(engine, n: int) -> list[list[int]]:
    texts = [f.format(s) for f in FORMS for s in SUBJECTS]
    return [engine.loaded.tokenizer.encode(texts[i % len(texts)] + " " * (i // len(texts))) for i in range(n)]


@dataclasses.dataclass
class BatchRun:
    tokens: list[list[int]]
    steps: int
    seconds: float
    rounds: int  # speculative rounds per member, summed
    k_histogram: dict[int, int]


def run_batch(engine, ids: list[list[int]], max_tokens: int, **request) -> BatchRun:
    """Prefill each prompt alone, then decode them all in one batch until every one has ended."""
    batch = BatchDecoder(engine)
    tokens: dict[int, list[int]] = {}
    runs = []
    for p in ids:
        run = engine.start(GenerationRequest(p, max_tokens=max_tokens, **request))
        tokens[id(run)] = [t for chunk in run.begin() if chunk is not None for t in chunk.token_ids]
        batch.add(run)
        runs.append(run)
    mx.eval([c.state for c in batch.cache])
    start = time.perf_counter()
    steps = 0
    rounds = 0
    histogram: dict[int, int] = {}
    while len(batch):
        for run, chunks in batch.step():
            for chunk in chunks:
                tokens[id(run)].extend(chunk.token_ids)
                if chunk.stats is not None:
                    rounds += chunk.stats.rounds
                    for k, n in chunk.stats.k_histogram.items():
                        histogram[k] = histogram.get(k, 0) + n
        steps += 1
    return BatchRun([tokens[id(r)] for r in runs], steps, time.perf_counter() - start, rounds, dict(sorted(histogram.items())))


def identity(run: BatchRun, solo: list[list[int]]) -> str:
    same, first = 0, []
    for got, want in zip(run.tokens, solo, strict=False):
        if got == want:
            same += 1
        else:
            first.append(next((j for j, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got)))
    return f"identical to solo {same}/{len(run.tokens)}" + (f" (first differences at {sorted(first)})" if first else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], nargs="+", default=[[1, 8, 32]])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mtp", action="store_true", help="also decode each batch with native MTP")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="forced depths for --mtp")
    parser.add_argument("--invariant", action="store_true", help="also decode each batch with the engine's "
                        "batch-invariant steps (EngineConfig.batch_invariant)")
    parser.add_argument("--vectors", action="store_true", help="also decode each batch with the batch-invariant "
                        "candidate (every linear layer's rows as one-row products)")
    args = parser.parse_args()
    sizes = sorted({s for group in args.sizes for s in group})
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    n = max(sizes)
    ids = prompts(engine, n)
    solo, solo_s = [], 0.0
    for p in ids:
        result = engine.complete(GenerationRequest(p, max_tokens=args.max_tokens, native_mtp="off"))
        solo.append(result.token_ids)
        solo_s += (args.max_tokens - 1) / max(result.stats.decode_tokens_per_s, 1e-9)
    decoded = args.max_tokens - 1  # per sequence, after the first token (prefill)
    print(f"{args.model} on {device_name()}, {args.max_tokens} tokens per sequence, greedy")
    print(f"solo plain decoding: {n * decoded / solo_s:.1f} tok/s (mean over {n} prompts)")
    if args.mtp:
        costs = engine.costs()
        print("warm-up costs (solo, in plain steps): beta " + " ".join(f"{b:.2f}" for b in costs.beta)
              + ", delta " + " ".join(f"{d:.2f}" for d in costs.delta))
    if args.vectors:
        print(f"--vectors: {batch_vectors(engine)} linear layers (with the lm_head) as one-row products in a batch")
    for size in sizes:
        plain = run_batch(engine, ids[:size], args.max_tokens, native_mtp="off")
        step_ms = plain.seconds / plain.steps * 1000
        plain_rate = size * decoded / plain.seconds
        print(f"B={size:3d}: {identity(plain, solo)}; step {step_ms:.2f} ms; {plain_rate:.1f} tok/s aggregate")
        if args.invariant:
            engine.config = dataclasses.replace(engine.config, batch_invariant=True)
            try:
                runs = [run_batch(engine, ids[:size], args.max_tokens, native_mtp="off") for _ in range(2)]
            finally:
                engine.config = dataclasses.replace(engine.config, batch_invariant=False)
            plain2 = run_batch(engine, ids[:size], args.max_tokens, native_mtp="off")
            base_ms = (plain.seconds + plain2.seconds) / (plain.steps + plain2.steps) * 1000
            inv_ms = sum(r.seconds for r in runs) / sum(r.steps for r in runs) * 1000
            print(f"       invariant: {identity(runs[0], solo)}, {identity(runs[1], solo)}; step {inv_ms:.2f} ms = "
                  f"{inv_ms / base_ms:.3f}x the batched step ({base_ms:.2f} ms, mean of two runs around it)")
            if args.mtp:
                engine.config = dataclasses.replace(engine.config, batch_invariant=True)
                try:
                    for k in args.ks:
                        run = run_batch(engine, ids[:size], args.max_tokens, mtp_k=k)
                        print(f"       invariant MTP K={k}: {identity(run, solo)}")
                finally:
                    engine.config = dataclasses.replace(engine.config, batch_invariant=False)
        if args.vectors:
            _BatchVectors.on = True
            try:
                vectors = run_batch(engine, ids[:size], args.max_tokens, native_mtp="off")
                again = run_batch(engine, ids[:size], args.max_tokens, native_mtp="off") if size > 1 else None
            finally:
                _BatchVectors.on = False
            plain2 = run_batch(engine, ids[:size], args.max_tokens, native_mtp="off")
            base_ms = (plain.seconds + plain2.seconds) / (plain.steps + plain2.steps) * 1000
            runs = [r for r in (vectors, again) if r is not None]
            vec_ms = sum(r.seconds for r in runs) / sum(r.steps for r in runs) * 1000
            print(f"       vectors : {identity(vectors, solo)}; step {vec_ms:.2f} ms = {vec_ms / base_ms:.3f}x the "
                  f"batched step ({base_ms:.2f} ms, mean of two runs around it)")
        if not args.mtp:
            continue
        for k in [*args.ks, None]:
            run = run_batch(engine, ids[:size], args.max_tokens, mtp_k=k)
            rate = size * decoded / run.seconds
            label = f"K={k}" if k is not None else "adaptive"
            line = f"       MTP {label:8s}: {identity(run, solo)}; "
            if k is not None:
                round_ms = run.seconds / run.steps * 1000
                gained = size * decoded / run.rounds if run.rounds else 0.0  # tokens per member per round
                line += f"round {round_ms:.2f} ms = {round_ms / step_ms:.2f} plain steps, {gained:.2f} tokens/round; "
            else:
                line += f"steps per depth {run.k_histogram}; "
            print(line + f"{rate:.1f} tok/s aggregate ({rate / plain_rate:.2f}x batched plain)")


if __name__ == "__main__":
    main()
