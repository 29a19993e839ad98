"""Measure MTP head agreement (exo.downloads.heads) of good and deliberately broken heads.

The numbers behind ``AGREEMENT_THRESHOLD``: for each (backbone, head source) pair, the agreement of the
head as recovery converts it, and of the same head broken the ways a conversion goes wrong.

    PYTHONPATH=src python scripts/measure_head_agreement.py                 # the bundled demo models
    PYTHONPATH=src python scripts/measure_head_agreement.py BACKBONE SOURCE [--random-source DIR] [--quantize]

BACKBONE: a checkpoint directory (its own head, if any, is ignored); SOURCE: a raw Hugging Face checkpoint
whose shards hold the head. The tests' fixtures are under ``$EXO_FIXTURE_DIR/<key>/<arch>/``
(e.g. ``mlx-none-bfloat16`` as BACKBONE, ``hf-trained-bfloat16`` as SOURCE, ``hf-random-bfloat16`` as
``--random-source``).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from exo.cards import bundled_model_dir
from exo.downloads.checks import read_index
from exo.downloads.heads import HeadSource, head_shards, head_weights, measure_agreement, read_head_tensors
from exo.engine.loader import MTPHeadError, build_head, load_checkpoint, sanitize_head_weights
from exo.engine.models.mtp import HEAD_NORM_SUFFIXES

Weights = dict[str, mx.array]


def source_of(path: Path) -> HeadSource:
    files = tuple(path / f for f in head_shards(read_index(path)))
    return HeadSource(path.name, "local", files)


def shifted_twice(weights: Weights) -> Weights:
    return {k: v + 1.0 if k.endswith(HEAD_NORM_SUFFIXES) and v.ndim == 1 else v for k, v in weights.items()}


def experts_permuted(weights: Weights) -> Weights:
    return {k: mx.roll(v, 1, axis=0) if ".switch_mlp." in k else v for k, v in weights.items()}


def gate_up_swapped(weights: Weights) -> Weights:
    out = dict(weights)
    gate, up = "layers.0.mlp.switch_mlp.gate_proj.weight", "layers.0.mlp.switch_mlp.up_proj.weight"
    out[gate], out[up] = weights[up], weights[gate]
    return out


def random_like(weights: Weights) -> Weights:
    mx.random.seed(0)
    return {
        k: (mx.zeros(v.shape, v.dtype) if k.endswith(HEAD_NORM_SUFFIXES) and v.ndim == 1
            else (0.02 * mx.random.normal(v.shape)).astype(v.dtype))
        for k, v in weights.items()
    }


def measure(backbone: Path, source: Path, random_source: Path | None, quantize: bool) -> dict[str, float | None]:
    loaded = load_checkpoint(backbone, load_head=False)
    raw, convention, _ = read_head_tensors(source_of(source).files)
    good, _ = sanitize_head_weights(raw, convention)
    moe = any(".switch_mlp." in k for k in good)
    variants: dict[str, Callable[[], Weights]] = {
        "good": lambda: good,
        "norm shift missed": lambda: sanitize_head_weights(raw, "mlx")[0],
        "norm shift twice": lambda: shifted_twice(good),
        "random": lambda: (
            sanitize_head_weights(*read_head_tensors(source_of(random_source).files)[:2])[0]
            if random_source else sanitize_head_weights(random_like(raw), "hf")[0]
        ),
    }
    if moe:
        variants["experts permuted"] = lambda: experts_permuted(good)
        variants["gate/up swapped"] = lambda: gate_up_swapped(good)
    if quantize:
        variants["good, quantized like the backbone"] = lambda: head_weights(loaded, source_of(source), True)[0]
    out: dict[str, float | None] = {}
    for name, make in variants.items():
        try:
            head, _ = build_head(loaded.model, make(), "mlx", name)
        except MTPHeadError as e:
            print(f"  {name}: cannot be built ({e})")
            out[name] = None
            continue
        agreement = measure_agreement(loaded, head)
        out[name] = round(agreement.rate, 3)
        print(f"  {name:<34} {agreement.rate:.3f} ({agreement.accepted}/{agreement.drafted})", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("backbone", nargs="?", type=Path)
    parser.add_argument("source", nargs="?", type=Path)
    parser.add_argument("--random-source", type=Path, default=None)
    parser.add_argument("--quantize", action="store_true", help="also the head quantized like the backbone")
    args = parser.parse_args()
    pairs = [(args.backbone, args.source)] if args.backbone else [
        (bundled_model_dir(m), bundled_model_dir(m)) for m in ("exo-demo", "exo-demo-moe")
    ]
    results = {}
    for backbone, source in pairs:
        print(f"{backbone.name} <- {source.name}", flush=True)
        results[f"{backbone} <- {source}"] = measure(backbone, source, args.random_source, args.quantize)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
