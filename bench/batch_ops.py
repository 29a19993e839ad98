"""Which operation of a batched decode step rounds differently from the same sequences' solo steps?

    python bench/batch_ops.py [MODEL] [--size 8] [--steps 32]

B prompts of different lengths are prefilled twice each: one copy joins a BatchDecoder's caches (mlx-lm's
BatchKVCache, left-padded, and the GatedDeltaNet rows), the other stays solo. Each step feeds the same
tokens (the solo greedy ones, so both stay aligned after a difference) through the batched forward and
through each solo forward, recording the output of every module of every decoder layer (each linear
layer, the attention / GatedDeltaNet mixer, the MLP or MoE block, the layer). Prints, per step, the first
module in call order whose output for some sequence differs from that sequence's solo output, and how
many greedy tokens differ; then, over all steps, how often each module was the first to differ.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

import mlx.core as mx
import mlx.nn as nn

from exo.engine import GenerationRequest, load
from exo.engine.batch import BatchDecoder
from exo.engine.costs import device_name
from exo.engine.models.layers import vector_matmul, vectors_apply

_VECTOR_CLASSES: dict[type, type] = {}


class _BatchVectors:
    """A bias-free linear layer whose rows (of every sequence) go as one-row products while ``on`` is set."""

    on = False

    def __call__(self, x: mx.array) -> mx.array:
        if not _BatchVectors.on or x.size == x.shape[-1]:
            return super().__call__(x)  # type: ignore[misc]
        return vector_matmul(x, self.weight)  # type: ignore[attr-defined]


def batch_vectors(engine) -> int:
    """Give every bias-free linear layer of the backbone and its lm_head the ``--vectors`` path (off until
    ``_BatchVectors.on``); returns how many layers."""
    model = engine.model
    count = 0
    for layer in model.stage_layers:
        for _, module in layer.named_modules():
            if vectors_apply(module):
                cls = type(module)
                if cls not in _VECTOR_CLASSES:
                    _VECTOR_CLASSES[cls] = type(f"BatchVectors{cls.__name__}", (_BatchVectors, cls), {})
                module.__class__ = _VECTOR_CLASSES[cls]
                count += 1
    weight = model.output_weight()
    if weight is not None:
        logits = model.logits
        object.__setattr__(model, "logits", lambda h: vector_matmul(h, weight) if _BatchVectors.on else logits(h))
        count += 1
    return count

RECORD: list[tuple[str, mx.array]] = []
_CLASSES: dict[type, type] = {}


class _Recording:
    record_name = ""

    def __call__(self, *args, **kwargs):
        out = super().__call__(*args, **kwargs)  # type: ignore[misc]
        RECORD.append((self.record_name, out))
        return out


def record(module: nn.Module, name: str) -> None:
    cls = type(module)
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Recording{cls.__name__}", (_Recording, cls), {})
    module.__class__ = _CLASSES[cls]
    object.__setattr__(module, "record_name", name)


def instrument(model) -> None:
    for i, layer in enumerate(model.stage_layers):
        for path, module in layer.named_modules():
            if isinstance(module, (nn.Linear, nn.QuantizedLinear)) or path in ("linear_attn", "self_attn", "mlp"):
                record(module, f"layer {i} {path}")
        record(layer, f"layer {i}")


def first_difference(batched: list[tuple[str, mx.array]], solo: list[list[tuple[str, mx.array]]]) -> str | None:
    for j, (name, out) in enumerate(batched):
        for i, alone in enumerate(solo):
            other_name, other = alone[j]
            assert other_name == name, (other_name, name)
            if not mx.array_equal(out[i : i + 1], other).item():
                return name
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--invariant", action="store_true", help="batched steps in the engine's batch-invariant "
                        "mode (EngineConfig.batch_invariant)")
    parser.add_argument("--vectors", action="store_true", help="batched steps with every linear layer's rows as "
                        "one-row products (batch_identity.py --vectors)")
    args = parser.parse_args()
    engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    tokenizer = engine.loaded.tokenizer
    subjects = ("the sea", "a lighthouse", "autumn", "a cat", "the moon", "a city", "rain", "mountains")
    texts = [f"Write a poem about {subjects[i % 8]}." + " and more" * (i // 2) for i in range(args.size)]
    ids = [tokenizer.encode(t) for t in texts]
    solo, batch = [], BatchDecoder(engine)
    for p in ids:
        pair = []
        for _ in range(2):
            run = engine.start(GenerationRequest(p, max_tokens=args.steps + 2, native_mtp="off"))
            for _chunk in run.begin():
                pass
            pair.append(run)
        solo.append(pair[0])
        batch.add(pair[1])
    if args.vectors:
        batch_vectors(engine)
    engine.model.set_batch_invariant(False)  # the linear layers take their batch-invariant class before recording
    instrument(engine.model)
    tokens = mx.concatenate([run.pending_token.reshape(1) for run in solo])
    firsts: Counter[str] = Counter()
    print(f"{args.model} on {device_name()}{' with --vectors' if args.vectors else ''}{' with --invariant' if args.invariant else ''}: B = {args.size} prompts of {sorted(len(p) for p in ids)} tokens, "
          f"{args.steps} decode steps")
    for step in range(args.steps):
        RECORD.clear()
        _BatchVectors.on = args.vectors
        engine.model.set_batch_invariant(args.invariant)
        hidden = engine.forward.hidden(tokens[:, None], batch.cache)
        weight = engine.model.output_weight() if args.invariant else None
        logits = vector_matmul(hidden, weight) if weight is not None else engine.model.logits(hidden)
        batched_next = mx.argmax(logits[:, -1], axis=-1)
        engine.model.set_batch_invariant(False)
        _BatchVectors.on = False
        mx.eval(batched_next, [out for _, out in RECORD])
        batched = list(RECORD)
        alone, solo_next = [], []
        for i, run in enumerate(solo):
            RECORD.clear()
            h = engine.forward.hidden(tokens[i].reshape(1, 1), run.cache)
            solo_next.append(mx.argmax(engine.model.logits(h)[:, -1], axis=-1))
            mx.eval(solo_next[-1], [out for _, out in RECORD])
            alone.append(list(RECORD))
        following = mx.concatenate(solo_next)
        flips = int((following != batched_next).sum().item())
        first = first_difference(batched, alone)
        firsts[first or "none"] += 1
        print(f"step {step:3d}: first module to differ: {first or 'none'}; greedy tokens differing: {flips}")
        tokens = following
    print("first module to differ, over the steps: " + ", ".join(f"{name} x{n}" for name, n in firsts.most_common()))


if __name__ == "__main__":
    main()
