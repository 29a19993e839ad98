"""What MLX's CUDA graphs make of a step full of all-reduces (issue 53: a tensor group ran 0.18x one GPU with MLX's
graphs on, 0.43x with them off).

    python bench/collective_graphs.py [--members 2] [--layers 32] [--width 4096] [--steps 40] [--graphs on off]
                                      [--nccl-env NAME=VALUE ...] [--dot]

MLX 0.32 captures a collective into the step's CUDA graph (``AllReduce::eval_gpu``: ``encoder.capture_context()``,
the NCCL call stream-captured into a child graph). The step's graph is then launched from MLX's cache of
instantiated graphs and updated in place where its nodes allow (``CommandEncoder::commit``): a node of a type
``subgraph_to_key`` does not know (a memcpy, a memory allocation, ...) or a kernel with a 2-D / 3-D cluster makes
the whole graph "not updatable", instantiated anew at every commit. Whether NCCL's captured nodes do that is the
question this answers, apart from any model:

Each member (one process per GPU, ``CUDA_VISIBLE_DEVICES``; on a machine without GPUs, MLX's ring over loopback on
the CPU) runs ``--steps`` steps of ``--layers`` x (a [1, W] x [W, W] product, an all-reduce, another product, an
all-reduce): a decode step's shape of collectives (two a layer, as ``engine.sharding.TensorLayer``), one
evaluation a step. For each ``--graphs`` value (``MLX_USE_CUDA_GRAPHS``, read once a process: fresh members each)
and each ``--nccl-env`` variant, it prints the median ms a step and, with ``--dot`` (``MLX_SAVE_CUDA_GRAPHS_DOT_FILE``),
how many graphs MLX committed a step and the node types in them (``cudaGraphDebugDotPrint``'s names). The same
chain without the all-reduces (``--no-collectives`` row) is the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

NODE_TYPES = ("KERNEL", "MEMCPY", "MEMSET", "HOST", "GRAPH", "EMPTY", "WAIT_EVENT", "EVENT_RECORD", "MEM_ALLOC",
              "MEM_FREE", "BATCH_MEM_OP", "CONDITIONAL", "EXT_SEMAS_SIGNAL", "EXT_SEMAS_WAIT")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=2)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--graphs", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--nccl-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="variants: each runs the graphs settings again with this NCCL variable set")
    parser.add_argument("--dot", action="store_true", help="count the committed graphs and their node types")
    parser.add_argument("--member", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--collectives", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.member is not None:
        return _member(args)
    gpus = _gpus()
    print(f"members {args.members} ({'one GPU each, NCCL' if gpus >= args.members else 'CPU, ring'}), "
          f"{args.layers} layers x 2 all-reduces of [1, {args.width}], {args.steps} steps; ms a step (median)")
    variants: list[tuple[str, dict[str, str]]] = [("", {})]
    variants += [(v, dict([v.split("=", 1)])) for v in args.nccl_env]
    for name, extra in variants:
        for graphs in args.graphs:
            for collectives in (1, 0):
                label = f"graphs {graphs}{', ' + name if name else ''}{'' if collectives else ', no collectives'}"
                row = _run(args, gpus, graphs == "on", collectives, extra)
                print(f"  {label:48s} {row['ms']:8.3f} ms" + (f"  {row['dot']}" if row.get("dot") else ""), flush=True)
    return 0


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: argparse.Namespace, gpus: int, graphs: bool, collectives: int, extra: dict[str, str]) -> dict:
    nccl = gpus >= args.members
    ports = [_free_port() for _ in range(args.members)]
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = Path(tmp) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
        dot = Path(tmp) / "dot"
        dot.mkdir()
        procs = []
        for rank in range(args.members):
            env = {**os.environ, **extra, "MLX_RANK": str(rank), "MLX_WORLD_SIZE": str(args.members),
                   "MLX_USE_CUDA_GRAPHS": "1" if graphs else "0"}
            if nccl:
                env.update(CUDA_VISIBLE_DEVICES=str(rank), NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(ports[0]))
            else:
                env["MLX_HOSTFILE"] = str(hostfile)
            if args.dot and rank == 0:
                env["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"] = str(dot / "g")
            cmd = [sys.executable, __file__, "--member", str(rank), "--layers", str(args.layers), "--width",
                   str(args.width), "--steps", str(args.steps), "--collectives", str(collectives)]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=600)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"a member failed: {[p.returncode for p in procs]}")
        row = json.loads(outs[0].strip().splitlines()[-1])
        files = sorted(dot.glob("g_*.dot"))
        if files:
            types: Counter[str] = Counter()
            for f in files:
                text = f.read_text(errors="replace")
                for t in NODE_TYPES:
                    types[t] += len(re.findall(rf"\b{t}\b", text))
            per_step = len(files) / max(1, row["evaluations"])
            row["dot"] = (f"{len(files)} graphs ({per_step:.1f} an evaluation); nodes: "
                          + ", ".join(f"{t} {n}" for t, n in types.most_common() if n))
    return row


def _member(args: argparse.Namespace) -> int:
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend="nccl" if os.environ.get("NCCL_HOST_IP") else "ring")
    key = mx.random.key(group.rank())
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    w1, w2 = ((mx.random.normal((args.width, args.width), key=k) * args.width**-0.5).astype(dtype)
              for k in mx.random.split(key, 2))
    x0 = mx.random.normal((1, args.width), key=key).astype(dtype)
    mx.eval(w1, w2, x0)

    def step(x: mx.array) -> mx.array:
        for _ in range(args.layers):
            h = x @ w1
            if args.collectives:
                h = mx.distributed.all_sum(h, group=group)
            x = x + (h @ w2) * 0.01
            if args.collectives:
                x = mx.distributed.all_sum(x, group=group) * (1.0 / group.size())
        return x

    x = x0
    for _ in range(3):  # warm-up (kernels compiled, graphs instantiated)
        x = step(x)
        mx.eval(x)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        x = step(x)
        mx.eval(x)
        times.append(time.perf_counter() - start)
    print(json.dumps({"ms": 1e3 * statistics.median(times), "evaluations": args.steps + 3}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
