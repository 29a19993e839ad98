"""How many operations a plain step, a verify call, the drafts and a batched step put on the device.

    python bench/graph_ops.py [MODEL] [--depths 1 2 3] [--batch 8] [--verify-rows per_row|batched|auto]

On an H200 a 9B decode step takes ~10 ms while reading its weights takes ~1 ms: decoding there is bound by how
many kernels a step launches, not by bandwidth, and a native-MTP round costs what its kernel count costs.
This counts them without a GPU: the lazy graph of each computation is exported (``mx.export_to_dot``) and
its primitives counted, views (reshape, slice, broadcast, transpose...) apart, since they launch nothing on
MLX CUDA. A proxy: on the GPU one primitive may launch a few kernels (an unfused attention) and a compiled
function's elementwise ops launch as one (counted as one ``Compiled``); on the CPU some layers take exo's own
kernels, so by default those are off here (``EXO_CPU_KERNELS=0``: the graphs MLX CUDA builds).

Prints per computation: operations (views apart), its ratio to the plain step, and the operation kinds that
grow most over the plain step. The verify call is built as on MLX CUDA by default: attention and logits per
row (``--verify-rows per_row``; ``auto``: this device's probe), GatedDeltaNet layers recording each row.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
from collections import Counter
from pathlib import Path

os.environ.setdefault("EXO_CPU_KERNELS", "0")  # before exo loads its kernels: the graphs MLX CUDA builds

import mlx.core as mx  # noqa: E402
from common import add_common_arguments, report_to, use_device  # noqa: E402  (bench/ is this script's folder)
from mlx_lm.models.cache import KVCache  # noqa: E402

from exo.engine import load  # noqa: E402
from exo.engine.costs import device_name  # noqa: E402
from exo.engine.forward import verify_call  # noqa: E402
from exo.engine.verify import VerifyMode, verify_logits  # noqa: E402

VIEWS = {"Reshape", "Slice", "Broadcast", "BroadcastAxes", "Transpose", "Squeeze", "ExpandDims", "AsStrided",
         "StopGradient", "Depends", "Split", "Flatten", "Unflatten", "NumberOfElements", "View"}


def count(outputs: list[mx.array]) -> Counter:
    """Primitives of the lazy graph that computes ``outputs`` (views apart), by kind."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "graph.dot"
        mx.export_to_dot(str(path), *outputs)
        labels = re.findall(r'\[label ="([^"]+)", shape=rectangle\]', path.read_text())
    return Counter(label.split(" ")[0] for label in labels if label.split(" ")[0] not in VIEWS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=1)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--verify-rows", choices=["per_row", "batched", "auto"], default="per_row")
    args = parser.parse_args()
    use_device(args.device)
    engine = load(args.model)
    model, forward, head = engine.model, engine.forward, engine.loaded.head
    vocab = int(model.text_model.embed_tokens.weight.shape[0])
    tokens = mx.random.randint(0, vocab, (1, args.context), key=mx.random.key(0))
    cache = forward.new_cache()
    hidden = forward.hidden(tokens, cache)
    mx.eval(hidden)
    one = tokens[:, -1:]
    graphs: dict[str, Counter] = {}

    step = mx.argmax(model.logits(model.stage_hidden(one, cache))[:, -1], axis=-1)
    graphs["plain step"] = count([step])
    mx.eval(step, [c.state for c in cache])  # (the context grows by this one token)
    mode = (forward.verify if args.verify_rows == "auto"
            else VerifyMode.forced("route_locked", args.verify_rows))
    for k in args.depths:
        rows = mx.concatenate([one] * (k + 1), axis=1)
        with verify_call(model, cache, mode):
            out = model.stage_hidden(rows, cache)  # one graph (the CPU's mid-graph evaluations left out)
            graphs[f"verify K={k}"] = count([mx.argmax(verify_logits(model, out, mode), axis=-1)])
        mx.eval(out)
        forward.rollback(cache, k + 1, 0)
    if head is not None:
        head_cache = KVCache()
        head(model.embed(tokens[:, 1:]), hidden[:, :-1], head_cache)
        mx.eval(head_cache.state)
        out = head(model.embed(one), hidden[:, -1:], head_cache)[:, -1:]
        graphs["one draft"] = count([mx.argmax(model.logits(out)[:, -1], axis=-1)])
    if args.batch > 1:
        batch = None
        for b in range(args.batch):
            member = forward.new_cache()
            mx.eval(forward.hidden(tokens[:, : args.context - b], member))  # unequal lengths: left padding
            batch = forward.join(batch, member)
        mx.eval([c.state for c in batch])  # the join's padding and concatenations are not the step's
        rows = mx.concatenate([one] * args.batch, axis=0)
        graphs[f"batched step, {args.batch} rows"] = count(
            [mx.argmax(model.logits(model.stage_hidden(rows, batch))[:, -1], axis=-1)])

    plain = graphs["plain step"]
    with report_to(args.json) as report:
        report.update(model=args.model, device=device_name(), verify_rows=args.verify_rows,
                      graphs={name: dict(c) for name, c in graphs.items()})
        print(f"device: {device_name()} (MLX {mx.__version__}), model {args.model}, "
              f"CPU kernels {os.environ.get('EXO_CPU_KERNELS')}, verify rows {args.verify_rows}")
        print(f"{'computation':>26} {'ops':>7} {'x plain':>8}  kinds that grow most over the plain step")
        for name, c in graphs.items():
            total = sum(c.values())
            grown = sorted(((n - plain.get(kind, 0), kind) for kind, n in c.items()), reverse=True)[:6]
            growth = ", ".join(f"{kind} +{n}" for n, kind in grown if n > 0)
            print(f"{name:>26} {total:7d} {total / sum(plain.values()):8.2f}  {growth}")
        print("\nthe plain step's kinds: " + ", ".join(f"{kind} {n}" for kind, n in plain.most_common()))


if __name__ == "__main__":
    main()
