"""Would a decode step whose layers are compiled functions cost the host less (issue 50's K = 1 round, a pipeline's
stages: MLX CUDA's 9B step is host-bound, its build ~5.6 of ~9.5 ms)? A measurement, nothing in the engine uses it.

    python bench/compiled_step.py [MODEL] [--context 256] [--steps 16] [--repeats 50] [--parts gdn,mlp layer]
                                  [--emulate-cuda]

Each GatedDeltaNet layer's decode step (its input projections, its recurrence, its gated norm and out projection:
a pure function of the row, the conv window and the state) and each layer's MLP become one ``mx.compile``d call
(the layer's weights captured as constants), where a step builds them op by op in Python now. Attention layers
stay as they are (their KV cache's write position is a Python int). In one process, alternating: ms per build of a
plain decode step and its logits (nothing evaluated; the caches put back after each: ``engine.ahead.Snapshot``),
and ms per step of ``--steps`` greedy decode steps evaluated one by one (build + evaluation), op by op and compiled;
then whether the compiled steps' logits are the op-by-op steps' bits (greedy tokens and every logit), which a
compiled function may not keep where MLX fuses elementwise ops. ``--parts``: which layers' parts to compile: "gdn"
(a GatedDeltaNet layer's mixer), "mlp", or "layer": the engine's compiled layers (``models.compiled_layers``,
``EXO_COMPILED_LAYERS``: a GatedDeltaNet decoder layer whole, an attention layer's parts around its attention);
the rows name each set, e.g. ``--parts gdn,mlp layer`` (default) times op by op and both.
``--emulate-cuda``: on a machine without a GPU, MLX CUDA's code paths with exo's launches stubbed
(``bench/common.py`` ``emulate_cuda``): builds only, the host's Python and MLX's graph for the GPU's ops.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
from common import add_emulate_argument, emulate_cuda  # bench/ is this script's folder

from exo.engine import forward as forward_module
from exo.engine import load
from exo.engine.ahead import Snapshot
from exo.engine.costs import device_name
from exo.engine.models import compiled_layers


class _Arrays:
    """The two arrays of a GatedDeltaNet layer's cache as the layer's step reads and writes them (traced)."""

    lengths = None

    def __init__(self, window: mx.array, state: mx.array) -> None:
        self.items = [window, state]

    def __getitem__(self, i: int) -> mx.array:
        return self.items[i]

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.items[i] = value

    def advance(self, n: int) -> None:
        pass


def compile_layers(model: Any, parts: set[str]) -> list[tuple[Any, str, Any]]:
    """Swap each layer's decode-step parts for compiled calls; returns what to put back (object, name, original)."""
    restore: list[tuple[Any, str, Any]] = []
    for layer in model.stage_layers:
        if "mlp" in parts:
            mlp = layer.mlp
            compiled = mx.compile(lambda x, mlp=mlp: mlp(x))
            restore.append((layer, "mlp", mlp))
            object.__setattr__(layer, "mlp", compiled)  # (an attribute, found before the module's children)
        gdn = getattr(layer, "linear_attn", None)
        if "gdn" in parts and gdn is not None:
            original = gdn.__call__

            def step(x: mx.array, window: mx.array, state: mx.array, gdn: Any = gdn) -> tuple[mx.array, ...]:
                arrays = _Arrays(window, state)
                out = type(gdn).__call__(gdn, x, None, arrays)
                return out, arrays[0], arrays[1]

            compiled_step = mx.compile(step)

            def call(x: mx.array, mask: Any = None, cache: Any = None, gdn: Any = gdn, compiled_step: Any = compiled_step,
                     original: Any = original) -> mx.array:
                if (mask is None and cache is not None and cache[0] is not None and cache[1] is not None
                        and x.shape[1] == 1 and not getattr(cache, "recording", False) and cache.lengths is None):
                    out, cache[0], cache[1] = compiled_step(x, cache[0], cache[1])
                    cache.advance(1)
                    return out
                return original(x, mask, cache)

            restore.append((layer, "linear_attn", gdn))
            object.__setattr__(layer, "linear_attn", call)
    return restore


def put_back(restore: list[tuple[Any, str, Any]]) -> None:
    for obj, name, original in reversed(restore):
        if obj is compiled_layers:
            compiled_layers.MODE = original
            continue
        object.__delattr__(obj, name)
        assert getattr(obj, name) is original


def swap(model: Any, parts: set[str]) -> list[tuple[Any, str, Any]]:
    """Compile ``parts`` of ``model``'s layers ("op by op": none); what to put back."""
    if not parts:
        return []
    if "layer" in parts:  # the engine's own (``models.compiled_layers``), switched on
        restore = [(compiled_layers, "MODE", compiled_layers.MODE)]
        compiled_layers.MODE = "always"
        return restore
    return compile_layers(model, parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="exo-demo")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--parts", nargs="+", default=["gdn,mlp", "layer"],
                        help="each a row: comma-separated parts of gdn, mlp, layer")
    add_emulate_argument(parser)
    args = parser.parse_args()
    if args.emulate_cuda:
        emulate_cuda()
    engine = load(args.model)  # (no warm-up: plain steps only, their kernels built by the warm pass below)
    model, forward = engine.model, engine.forward
    forward_module.VERIFY_EVAL_EVERY = forward_module.VERIFY_EVAL_EVERY_GPU = 0
    cache = forward.new_cache()
    prompt = mx.array([[(7 * i) % engine.vocab_size for i in range(args.context)]], dtype=mx.uint32)
    prefilled = forward.hidden(prompt, cache)
    if not args.emulate_cuda:
        mx.eval(prefilled)
    snapshot = Snapshot(cache)
    token = mx.array([[5]], dtype=mx.uint32)
    print(f"{engine.loaded.model_id} on {device_name()}{' (MLX CUDA emulated: builds only)' if args.emulate_cuda else ''}, "
          f"context {args.context}, compiled parts: {' / '.join(args.parts)}")

    def builds(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            hidden = forward.hidden(token, cache)
            model.logits(hidden)
            snapshot.restore()
        return (time.perf_counter() - start) / n

    def decode() -> tuple[float, list[int], list[mx.array]]:
        tokens, logits, t = [], [], token
        start = time.perf_counter()
        for _ in range(args.steps):
            out = model.logits(forward.hidden(t, cache))[:, -1]
            t = mx.argmax(out, axis=-1).astype(mx.uint32).reshape(1, 1)
            mx.eval(t, out)
            tokens.append(int(t.item()))
            logits.append(out)
        seconds = (time.perf_counter() - start) / args.steps
        snapshot.restore()
        return seconds, tokens, logits

    rows = {"op by op": set(), **{name: set(name.split(",")) for name in args.parts}}
    unknown = set().union(*rows.values()) - {"gdn", "mlp", "layer"}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}: gdn, mlp, layer")
    results: dict[str, dict[str, list[float]]] = {name: {"build": [], "step": []} for name in rows}
    outputs: dict[str, tuple[list[int], list[mx.array]]] = {}
    try:
        for name, parts in rows.items():  # warm: kernels built, traces compiled
            restore = swap(model, parts)
            builds(3)
            if not args.emulate_cuda:
                _, tokens, logits = decode()
                outputs[name] = (tokens, logits)
            put_back(restore)
        for _ in range(3):
            for name, parts in rows.items():
                restore = swap(model, parts)
                results[name]["build"].append(builds(args.repeats))
                if not args.emulate_cuda:
                    results[name]["step"].append(decode()[0])
                put_back(restore)
    except Exception as e:  # noqa: BLE001 - the finding is that it cannot be compiled here
        print(f"compiled: {type(e).__name__}: {str(e)[:500]}")
        return
    base = statistics.median(results["op by op"]["build"])
    base_step = statistics.median(results["op by op"]["step"]) if not args.emulate_cuda else 0.0
    for name, values in results.items():
        build = statistics.median(values["build"])
        line = f"{name:>9}: build {1e3 * build:.2f} ms ({build / base:.2f}x)"
        if not args.emulate_cuda:
            step = statistics.median(values["step"])
            line += f", step built and evaluated {1e3 * step:.2f} ms ({step / base_step:.2f}x)"
        print(line)
    if args.emulate_cuda:
        return
    reference = outputs["op by op"]
    for name in args.parts:
        same_tokens = outputs[name][0] == reference[0]
        same_bits = same_tokens and all(mx.array_equal(a, b).item()
                                        for a, b in zip(outputs[name][1], reference[1], strict=True))
        print(f"{name}: greedy tokens equal op by op's: {same_tokens}; every logit's bits equal: {same_bits}")

if __name__ == "__main__":
    main()
