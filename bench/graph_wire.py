"""Where a pipeline's graph wire stops (``EXO_PIPELINE_WIRE=graph``; opt-in since its first run on 2 x H200 stopped).

    python bench/graph_wire.py [MODEL] [--patterns sync,stage,leader,both,header,alloc] [--steps 64]
                               [--timeout 40] [--gpu-per-rank] [--model-timeout 120] [--no-model]

Two processes over loopback (``exo.runner.group.join_group``, the ring backend, as a pipeline's stages) pass arrays
as ops of their graphs (``RingLink.send_op`` / ``recv_op``) in patterns ever closer to a pipeline's steps, each
pattern in fresh processes under a time limit; rank 0 plays the first stage (receives ids, computes, sends hidden
states), rank 1 the leader (sends ids, receives hidden states, computes the next ids from them):

- sync: both evaluate every transfer as they go (the ops alone, no step started ahead);
- stage: the stage starts each step (``async_eval``) and goes on to the next; the leader waits for each;
- leader: the leader as ``PipelineForward.hidden`` on the graph wire (its ids evaluated alone, then their send
  started; the receive evaluated with the step built on it, so its device ops wait on the host); the stage waits
  for each;
- both: both as on the graph wire (each step started, nothing waited for until the end);
- header: both, plus a host message per step on the doorbell before the step (the step header);
- alloc: both, the host allocating and freeing device buffers while steps are in flight (MLX's cache cleared:
  a device-wide free synchronizes the device, where a step waits for bytes);
- leader-spin, both-spin: the leader as its first graph wire did (the receive started in an evaluation of its
  own, the step built on it evaluated after: on MLX CUDA the step's first device op waits for the receive in a
  kernel spinning on the device, its event's buffer freed with a device-wide ``cudaFree`` on another thread):
  the first run on 2 x H200 stopped.

Each prints ok and milliseconds per step, or that it stopped: every thread's stack of each process at the limit
(``faulthandler``). Then MODEL (default exo-demo) as a 2-stage pipeline on the graph wire (``run_local_pipeline``,
a plain and a K = 1 request), its tokens against the host wire's, or the stages' stacks where it stopped
(``EXO_STAGE_TRACEBACK_S``). ``--gpu-per-rank``: rank i on GPU i (CUDA_VISIBLE_DEVICES), else both share the device.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import free_port  # noqa: E402

PATTERNS = ("sync", "stage", "leader", "both", "header", "alloc", "leader-spin", "both-spin")

MEMBER = r"""
import faulthandler, sys, time
pattern, rank, hosts, steps, limit = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4]), float(sys.argv[5])
faulthandler.dump_traceback_later(limit, exit=True)
import mlx.core as mx
from exo.runner.group import join_group

link = join_group(hosts, rank)
H = 4096
mx.random.seed(rank)
w = (mx.random.normal((H, H)) / H ** 0.5).astype(mx.bfloat16)
table = mx.random.normal((256, H)).astype(mx.bfloat16)
mx.eval(w, table)
other = 1 - rank
waits = pattern in ("sync",)
stage_waits = pattern in ("sync", "leader", "leader-spin")
leader_waits = pattern in ("sync", "stage")
spin = pattern.endswith("-spin")
header = pattern == "header"


def start(x, wait):  # waited for, or started and left
    mx.eval(x) if wait else mx.async_eval(x)


def churn(t, phase):  # the alloc pattern: device memory allocated and freed every 4th step, the cache cleared
    if pattern == "alloc" and t % 4 == phase:
        junk = mx.zeros((64, 1024, 1024))
        mx.eval(junk)
        del junk
        mx.clear_cache()


print(f"rank {rank} joined ({mx.default_device()})", flush=True)
started = time.perf_counter()
if rank == 0:  # the first stage: ids in, hidden states out
    for t in range(steps):
        if header:
            values = link.recv((4,), mx.int32, other)
            mx.eval(values)
        ids = link.recv_op((1,), mx.uint32, other)
        h = table[ids.astype(mx.int32) % 256]
        for _ in range(4):
            h = mx.tanh(h @ w)
        sent = link.send_op(h.astype(mx.bfloat16), other)
        start(sent, stage_waits)
        churn(t, 0)
        if t % 16 == 0:
            print(f"rank 0 step {t}", flush=True)
    mx.eval(sent)
else:  # the leader: ids out, hidden states in, the next ids from them
    ids = mx.array([7], dtype=mx.uint32)
    for t in range(steps):
        if header:
            link.send(mx.array([t, 1, 1, 0], dtype=mx.int32), other)
        if leader_waits:
            mx.eval(link.send_op(ids, other))
        else:
            mx.async_eval(ids)  # (its own evaluation: the send waits for it on the link's stream)
            mx.async_eval(link.send_op(ids, other))
        h = link.recv_op((1, H), mx.bfloat16, other)
        if leader_waits or spin:
            start(h, leader_waits)
        for _ in range(4):
            h = mx.tanh(h @ w)
        ids = (mx.argmax(h, axis=-1) % 256).astype(mx.uint32).reshape(1)
        start(ids, leader_waits)
        churn(t, 2)
        if t % 16 == 0:
            print(f"rank 1 step {t}", flush=True)
    mx.eval(ids)
print(f"rank {rank} done: {1000 * (time.perf_counter() - started) / steps:.3f} ms a step", flush=True)
"""


def run_pattern(pattern: str, steps: int, limit: float, gpu_per_rank: bool) -> tuple[bool, str]:
    hosts = ",".join(f"127.0.0.1:{free_port()}" for _ in range(2))
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if gpu_per_rank:
            env["CUDA_VISIBLE_DEVICES"] = str(rank)
        procs.append(subprocess.Popen([sys.executable, "-c", MEMBER, pattern, str(rank), hosts, str(steps), str(limit)],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env))
    outputs = []
    deadline = time.monotonic() + limit + 30
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outputs.append(p.communicate()[0])
    ok = all(p.returncode == 0 for p in procs) and all("done:" in o for o in outputs)
    if ok:
        return True, "; ".join(next(line for line in o.splitlines() if "done:" in line) for o in outputs)
    return False, "\n".join(f"  -- rank {rank} (exit {p.returncode}):\n" + "\n".join(
        "    " + line for line in o.splitlines()[-40:]) for rank, (p, o) in enumerate(zip(procs, outputs, strict=True)))


def run_model(model: str, limit: float, gpu_per_rank: bool) -> None:
    from exo.engine import load_checkpoint, resolve_model
    from exo.runner.local_pipeline import LocalPipelineError, run_local_pipeline

    resolved = resolve_model(model)
    n = load_checkpoint(resolved.path).model.num_layers
    stages = [(0, n // 2), (n // 2, n)]
    requests = [{"prompt": list(range(10, 60)), "max_tokens": 32, "ignore_eos": True, "native_mtp": "off"},
                {"prompt": list(range(10, 60)), "max_tokens": 32, "ignore_eos": True, "mtp_k": 1, "native_mtp": "on"}]
    tokens = {}
    for wire in ("host", "graph"):
        env = [{"EXO_PIPELINE_WIRE": wire, "EXO_STAGE_TRACEBACK_S": str(max(5.0, limit - 15)),
                **({"CUDA_VISIBLE_DEVICES": str(rank)} if gpu_per_rank else {})} for rank in range(2)]
        started = time.perf_counter()
        try:
            out = run_local_pipeline(resolved.path, stages, requests, timeout_s=limit, stage_env=env, warmup=True)
        except LocalPipelineError as e:
            print(f"{resolved.model_id} on the {wire} wire: stopped\n{str(e)[-12000:]}", flush=True)
            continue
        tokens[wire] = [r["token_ids"] for r in out["results"]]
        rates = ", ".join(f"{r['stats']['decode_tokens_per_s']:.1f}" for r in out["results"])
        print(f"{resolved.model_id} on the {out['wire']} wire: ok in {time.perf_counter() - started:.1f} s, decode tok/s "
              f"plain, K = 1: {rates}", flush=True)
    if len(tokens) == 2:
        print(f"the graph wire's tokens equal the host wire's: {tokens['graph'] == tokens['host']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default="exo-demo", help="card id, repo or directory (default: exo-demo)")
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--timeout", type=float, default=40.0, help="seconds a pattern may take before its stacks are dumped")
    p.add_argument("--gpu-per-rank", action="store_true", help="rank i on GPU i (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--model-timeout", type=float, default=120.0)
    p.add_argument("--no-model", dest="model_run", action="store_false", help="the patterns only")
    args = p.parse_args(argv)
    for pattern in args.patterns.split(","):
        if pattern not in PATTERNS:
            p.error(f"unknown pattern {pattern!r} (one of {', '.join(PATTERNS)})")
        started = time.perf_counter()
        ok, what = run_pattern(pattern, args.steps, args.timeout, args.gpu_per_rank)
        print(f"{pattern:>7}: {'ok' if ok else 'STOPPED'} in {time.perf_counter() - started:.1f} s: {what}", flush=True)
    if args.model_run:
        run_model(args.model, args.model_timeout, args.gpu_per_rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
