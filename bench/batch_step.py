"""Where a batched decode step's time goes, at each batch size: the model's forward on B rows of one token.

    python bench/batch_step.py MODEL [--sizes 1 8 32] [--context 512] [--steps 8] [--repeats 3]

Serving many clients lives on one fact: on a device whose decoding is bound by reading the weights, a step of
B rows should cost little more than a step of one. This measures that on MODEL's own layers, without the
engine's batch bookkeeping (bench/batch_identity.py times the engine's batched steps; bench/serving.py the
server). B sequences of ``--context`` random tokens are prefilled together (mlx-lm's caches hold B equal
rows: no padding), then, for each B:

1. ``step``: the whole forward of one token per row plus the last rows' logits, one evaluation a step (as the
   engine decodes), ms per step and its ratio to B=1's;
2. ``parts``: the same steps with each part of every layer evaluated on its own (a device sync after each,
   so the parts' sum exceeds the real step by the syncs' latency): the GatedDeltaNet mixers, the attention
   mixers, the MLPs (or MoE blocks), the norms and residuals left over, the lm_head;
3. ``linears``: every quantized (or plain) linear layer of one GatedDeltaNet layer, one attention layer, one
   MLP and the lm_head, by shape: its time at B rows and the ratio to one row (a row count where MLX switches
   kernels shows as a jump), times how often the forward runs it.

A B whose step costs ~B x the one-row step is compute- or kernel-bound where it should be bandwidth-bound: the
parts and linears say which op.

``--dense-batch``: the model loaded with ``EXO_BATCH_DENSE=on`` (unless the variable is set: ``on:ROWS`` on the CPU),
and every ``step`` timed twice, alternating: with a batch step's products on dequantized weights
(``engine/models/prompt_dense.py``) and with the layers' own quantized products (``prompt_dense.suspended``): the
ratio per B, and how far the two steps' logits are apart. With ``EXO_BATCH_DENSE=keep`` (the weights dequantized
once at load and held) also a third way, dequantizing for each step (``prompt_dense.transient``); each way's peak of
MLX's memory (arrays held) over its steps beside its time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from common import add_common_arguments, report_to, use_device  # bench/ is this script's folder

from exo.engine import load_checkpoint, resolve_model
from exo.engine.costs import device_name
from exo.engine.models import prompt_dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=512, help="tokens in each row's caches before the steps")
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per repeat")
    parser.add_argument("--phases", nargs="+", default=["step", "parts", "linears"])
    parser.add_argument("--dense-batch", action="store_true",
                        help="each step timed with EXO_BATCH_DENSE's dense products and without, alternating")
    args = parser.parse_args()
    use_device(args.device)
    if args.dense_batch:
        os.environ.setdefault("EXO_BATCH_DENSE", "on")
    loaded = load_checkpoint(resolve_model(args.model).path)
    model = loaded.model
    with report_to(args.json) as report:
        report.update(model=args.model, device=device_name(), mlx=mx.__version__, context=args.context)
        print(f"device: {device_name()} (MLX {mx.__version__}), model {args.model}, context {args.context}")
        vocab = int(model.text_model.embed_tokens.weight.shape[0])
        rows: dict[str, dict[int, Any]] = defaultdict(dict)
        for B in args.sizes:
            cache = model.make_cache()
            prompt = mx.random.randint(0, vocab, (B, args.context), key=mx.random.key(B))
            mx.eval(model.logits(model.hidden(prompt, cache)[:, -1:]))
            token = mx.zeros((B, 1), dtype=mx.int32)

            def step(token: mx.array = token, cache: list[Any] = cache) -> mx.array:
                return model.logits(model.hidden(token, cache))
            for _ in range(2):  # warm-up: kernels compiled for this B
                mx.eval(step())
            if "step" in args.phases and args.dense_batch:
                held = "dense weights held" in loaded.dense
                ways = _dense_or_not(step, args.steps, args.repeats, held)
                rows["step"][B], rows["quantized step"][B] = ways["as loaded"][0], ways["quantized"][0]
                rows["dense ways"][B] = ways
                rows["logits apart"][B] = _apart(model, token, cache)
            elif "step" in args.phases:
                rows["step"][B] = _per_step(step, args.steps, args.repeats)
            if "parts" in args.phases:
                with _timed_parts(model) as parts:
                    for _ in range(args.steps):
                        parts.run("lm_head + rest", step)
                rows["parts"][B] = {k: v / args.steps for k, v in parts.total().items()}
            if "linears" in args.phases:
                rows["linears"][B] = _linears(model, B, args.repeats)
            del cache, step
            mx.clear_cache()
        report.update(rows)
        _print(rows, args.sizes)


def _apart(model: Any, token: mx.array, cache: list[Any]) -> float:
    """One step's logits from copies of the caches, as loaded against the batch's products quantized: the largest
    difference over the largest logit."""
    dense = model.logits(model.hidden(token, copy.deepcopy(cache))).astype(mx.float32)
    with prompt_dense.suspended():
        quantized = model.logits(model.hidden(token, copy.deepcopy(cache))).astype(mx.float32)
    return (mx.abs(dense - quantized).max() / mx.abs(quantized).max()).item()


def _dense_or_not(step: Callable[[], mx.array], steps: int, repeats: int,
                  held: bool) -> dict[str, tuple[float, float]]:
    """Way -> (s per step, peak GiB of MLX's arrays over its steps): as loaded, with the batch's products quantized
    and, where the load holds dense weights, dequantizing them for each step; the ways alternating ``repeats``
    times."""
    ways: dict[str, Callable[[], Any]] = {"as loaded": contextlib.nullcontext, "quantized": prompt_dense.suspended}
    if held:
        ways["dequantized per step"] = prompt_dense.transient
    for way in ways.values():
        with way():
            mx.eval(step())  # (warm: each path's kernels)
    times: dict[str, list[float]] = defaultdict(list)
    peaks: dict[str, float] = defaultdict(float)
    for _ in range(max(1, repeats)):
        for name, way in ways.items():
            mx.synchronize()
            mx.reset_peak_memory()
            with way():
                times[name].append(_per_step(step, steps, 1))
            peaks[name] = max(peaks[name], mx.get_peak_memory() / 2**30)
    return {name: (statistics.median(times[name]), peaks[name]) for name in ways}


def _per_step(step: Callable[[], mx.array], steps: int, repeats: int) -> float:
    times = []
    for _ in range(max(1, repeats)):
        mx.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            mx.eval(step())
        mx.synchronize()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


class _Parts:
    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.inner = 0.0  # time inside timed parts during the current ``run``

    def timed(self, name: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        mx.synchronize()
        start = time.perf_counter()
        out = fn(*a, **kw)
        mx.eval(out)
        mx.synchronize()
        took = time.perf_counter() - start
        self.s[name] += took
        self.inner += took
        return out

    def run(self, rest: str, fn: Callable[[], mx.array]) -> None:
        """``fn`` with its parts timed; what it spends outside them is ``rest``."""
        self.inner = 0.0
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        self.s[rest] += time.perf_counter() - start - self.inner

    def total(self) -> dict[str, float]:
        return dict(self.s)


@contextmanager
def _timed_parts(model: Any) -> Iterator[_Parts]:
    """Each layer's mixer and MLP evaluated on its own while the model runs (their classes swapped for a
    subclass that times the call; restored after)."""
    parts = _Parts()
    swapped: list[tuple[nn.Module, type]] = []
    for layer in model.text_model.layers:
        for attr, name in (("linear_attn", "gated delta net mixer"), ("self_attn", "attention mixer"),
                           ("mlp", "mlp / moe")):
            module = getattr(layer, attr, None) if attr in layer else None
            if module is None:
                continue
            cls = type(module)

            def call(self, *a: Any, _cls=cls, _name=name, **kw: Any) -> Any:
                return parts.timed(_name, super(type(self), self).__call__, *a, **kw)

            module.__class__ = type(f"Timed{cls.__name__}", (cls,), {"__call__": call})
            swapped.append((module, cls))
    try:
        yield parts
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def _linears(model: Any, B: int, repeats: int) -> dict[str, dict[str, Any]]:
    """Each distinct linear shape of the forward at B rows: ms per call and how often a step runs it."""
    counts: dict[tuple, int] = defaultdict(int)
    examples: dict[tuple, tuple[str, nn.Module]] = {}
    modules = list(model.text_model.layers) + [model.output_projection()]
    for i, layer in enumerate(modules):
        named = [("lm_head", layer)] if i == len(modules) - 1 else layer.named_modules()
        for name, m in named:
            if not isinstance(m, (nn.Linear, nn.QuantizedLinear, nn.QuantizedEmbedding, nn.Embedding)):
                continue
            key = (type(m).__name__, tuple(m.weight.shape), getattr(m, "bits", None), str(m.weight.dtype))
            counts[key] += 1
            examples.setdefault(key, (name.split(".")[-1] or name, m))
    out = {}
    for key, (name, m) in examples.items():
        width = _in_features(m)
        x = mx.random.normal((B, 1, width)).astype(mx.bfloat16)
        fn = m.as_linear if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)) else m
        mx.eval(fn(x))
        n = 20
        times = []
        for _ in range(max(1, repeats)):
            mx.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                mx.eval(fn(x))
            mx.synchronize()
            times.append((time.perf_counter() - start) / n)
        out[f"{name} {key[1]} {key[2] or ''}"] = {"ms": statistics.median(times) * 1e3, "per_step": counts[key]}
    return out


def _in_features(m: nn.Module) -> int:
    if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return m.weight.shape[1] * 32 // m.bits
    return m.weight.shape[1]


def _print(rows: dict[str, dict[int, Any]], sizes: list[int]) -> None:
    one = sizes[0]
    if rows.get("step"):
        print(f"\n[step] the forward of one token per row + logits, ms per step (x: vs B={one})")
        for B in sizes:
            ms = rows["step"][B] * 1e3
            print(f"  B={B:>3} {ms:9.2f} ms  {rows['step'][B] / rows['step'][one]:6.2f}x  "
                  f"{B / rows['step'][B]:9.1f} rows/s")
    if rows.get("quantized step"):
        print("\n[dense batch] the same steps with the batch's products quantized (prompt_dense.suspended), alternating")
        for B in sizes:
            q = rows["quantized step"][B]
            print(f"  B={B:>3} quantized {q * 1e3:9.2f} ms, as loaded {rows['step'][B] * 1e3:9.2f} ms: "
                  f"{q / rows['step'][B]:5.2f}x faster as loaded; logits apart {rows['logits apart'][B]:.2e} of the largest")
        print("  each way's time and peak of MLX's arrays over its steps:")
        for B in sizes:
            print(f"  B={B:>3} " + ", ".join(f"{name} {t * 1e3:.2f} ms (peak {peak:.2f} GiB)"
                                            for name, (t, peak) in rows["dense ways"][B].items()))
    if rows.get("parts"):
        print(f"\n[parts] per step, each part evaluated on its own (a sync each), ms (x: vs B={one})")
        names = sorted(rows["parts"][one], key=lambda k: -rows["parts"][one][k])
        print("  " + f"{'part':>24}" + "".join(f"{'B=' + str(B):>16}" for B in sizes))
        for name in [*names, "sum"]:
            cells = []
            for B in sizes:
                v = sum(rows["parts"][B].values()) if name == "sum" else rows["parts"][B].get(name, 0.0)
                base = sum(rows["parts"][one].values()) if name == "sum" else rows["parts"][one].get(name, 0.0)
                cells.append(f"{v * 1e3:9.2f} {v / base if base else 0:5.2f}x")
            print("  " + f"{name:>24}" + "".join(f"{c:>16}" for c in cells))
    if rows.get("linears"):
        print(f"\n[linears] one call at B rows, ms (x: vs B={one}); per step: how often a step runs it")
        print("  " + f"{'linear (weight shape, bits)':>44} {'per step':>8}" + "".join(f"{'B=' + str(B):>16}" for B in sizes))
        first = rows["linears"][one]
        for name in sorted(first, key=lambda k: -first[k]["ms"] * first[k]["per_step"]):
            cells = [f"{rows['linears'][B][name]['ms']:9.3f} {rows['linears'][B][name]['ms'] / first[name]['ms']:5.2f}x"
                     for B in sizes]
            print("  " + f"{name:>44} {first[name]['per_step']:>8}" + "".join(f"{c:>16}" for c in cells))


if __name__ == "__main__":
    main()
