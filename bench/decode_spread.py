"""One device's plain decoding speed from process to process, each process pinned to a set of CPUs or not.

    python bench/decode_spread.py MODEL [--settings all 1 2 4 2+sib] [--processes 3] [--max-tokens 64]
                                        [--requests 3] [--first-cpu 2] [--json]

On the H200 machines a 9B's greedy decoding ran 128-216 tok/s in processes started one after another on the same
GPU with nothing else running, steady within each process (docs/performance.md, "Figures still to measure"): a
decode step there is the host's work (building and launching ~700 kernels), so every ratio against one GPU
inherited the spread. This starts ``--processes`` processes per setting, the settings interleaved (a drifting
host hits all of them), each one loading MODEL, warming up and decoding ``--requests`` of ``exo bench``'s prompts
``--max-tokens`` tokens each (MTP off, EOS ignored). A setting is ``all`` (not pinned: the CPUs the scheduler
gives), ``N`` (pinned to N CPUs from ``--first-cpu`` on, one per core where the machine has SMT siblings),
``N+sib`` (N cores with their SMT siblings), an explicit list (``4,5``), ``hash=N`` (not pinned, Python's hash
seed fixed at N: whether the order of sets differing between processes is the spread) or ``runner`` (not pinned, the
process set up as a runner sets up its own: ``runner_engine``; whether a runner's process draws slower than another)
or ``runner-full`` (the same, MLX's buffer cache left as the warm-ups leave it: at its bound, 18 GB on an H200, as
runners had it before ``engine.memory.keep_cache_room``) or ``runner-staged`` (one process set up as a runner step by
step, its decoding measured after each step, and a plain engine of the same process first and last: which step of a
runner's set-up makes its decoding slower, with no process-to-process spread in the comparison). Each process reports its decode tok/s
per request, the CPU its main thread ended on, the CPU seconds of its busiest threads (the main thread and
MLX's: which threads the step keeps busy), and its host's speed apart from the model (``host_probe``).

Prints per setting every process's median tok/s, the setting's median and its spread (max / min), and the
machine's CPUs (model, SMT, the allowed set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import add_common_arguments, report_to, stop_on_signals  # bench/ is this script's folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_arguments(parser, repeats=1, device=False)  # (--repeats unused: --processes)
    parser.add_argument("--settings", nargs="+", default=["all", "1", "2", "4"],
                        help="CPU sets: all, N, N+sib, or a list like 4,5 (default: all 1 2 4)")
    parser.add_argument("--processes", type=int, default=3, help="processes per setting (default 3)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=3, help="timed requests per process (default 3)")
    parser.add_argument("--first-cpu", type=int, default=2,
                        help="where pinned sets start among the allowed CPUs (default 2: clear of CPU 0's interrupts)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--runner", choices=("keep", "full", "staged"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    stop_on_signals()
    with report_to(args.json) as report:
        run(args, report)


def siblings() -> dict[int, list[int]]:
    """CPU -> the CPUs of its core (itself included), from sysfs (each CPU alone where it says nothing)."""
    out: dict[int, list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        cpus = [cpu]
        if path.exists():
            cpus = []
            for part in path.read_text().strip().split(","):
                a, _, b = part.partition("-")
                cpus += list(range(int(a), int(b or a) + 1))
        out[cpu] = cpus
    return out


def cpu_set(setting: str, first: int) -> list[int] | None:
    """The CPUs of a setting (None: not pinned)."""
    if setting in ("all", "runner", "runner-full", "runner-staged") or setting.startswith("hash="):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    if "," in setting:
        return [int(c) for c in setting.split(",")]
    with_siblings = setting.endswith("+sib")
    n = int(setting.removesuffix("+sib"))
    cores: list[list[int]] = []
    seen: set[int] = set()
    sib = siblings()
    for cpu in allowed[first:] + allowed[:first]:
        if cpu in seen:
            continue
        core = [c for c in sib[cpu] if c in allowed]
        seen.update(core)
        cores.append(core if with_siblings else [cpu])
        if len(cores) == n:
            break
    if len(cores) < n:
        raise SystemExit(f"setting {setting}: only {len(cores)} cores allowed here")
    return [c for core in cores for c in core]


def threads_cpu() -> list[tuple[str, float]]:
    """(name, CPU seconds) of this process's threads, busiest first."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        out.append((name, (int(fields[11]) + int(fields[12])) / tick))
    return sorted(out, key=lambda t: -t[1])


def host_probe() -> dict[str, float]:
    """What this process's host does apart from the model, medians of 3: ms of a pure-Python loop (a dict of
    300k ints built and summed), ms of building a chain of 3,000 MLX adds (no evaluation), ms of evaluating
    it, and GB/s of copying 256 MB with numpy. Against the process's decode speed: whether a slow process is
    slow at everything (where its memory or CPU landed) or at the device's work alone."""
    import mlx.core as mx
    import numpy as np

    out: dict[str, list[float]] = {"python_ms": [], "build_ms": [], "eval_ms": [], "copy_gb_s": []}
    big = np.ones(256 << 20, dtype=np.uint8)
    for _ in range(3):
        t = time.perf_counter()
        d = {i: i * 2 for i in range(300_000)}
        sum(d.values())
        out["python_ms"].append(1000 * (time.perf_counter() - t))
        x = mx.zeros((1, 16))
        mx.eval(x)
        t = time.perf_counter()
        for _ in range(3000):
            x = x + 1
        out["build_ms"].append(1000 * (time.perf_counter() - t))
        t = time.perf_counter()
        mx.eval(x)
        out["eval_ms"].append(1000 * (time.perf_counter() - t))
        t = time.perf_counter()
        big.copy()
        out["copy_gb_s"].append(big.nbytes / 1e9 / (time.perf_counter() - t))
    return {k: statistics.median(v) for k, v in out.items()}


def runner_engine(model: str, keep_room: bool = True) -> object:
    """An engine in a process set up as a runner sets up its own (``runner.main``): the process's settings
    (``prepare_process``: the GIL's switch interval, MLX's PTX cache), MLX's buffer cache bounded, the engine readied
    with the node's settings (its batches warmed up, its state room, its prefix cache), the runner's gRPC service
    listening (idle), the device queue's thread parked; only the decoding stays on this thread, as ``engine.complete``.
    ``keep_room`` False: MLX's cache left as the warm-ups leave it (at its bound: ``engine.memory.keep_cache_room``
    off, as runners were before it), and decoding outside the device's loop, which would keep room at its steps."""
    import tempfile

    from exo.engine import resolve_model
    from exo.engine.memory import limit_buffer_cache
    from exo.runner.device import Device
    from exo.runner.loading import load_for_serving, ready_engine
    from exo.runner.main import prepare_process
    from exo.runner.service import RunnerState, start_server
    from exo.settings import load_settings
    from exo.wire.proto_gen import node_pb2 as pb

    os.environ.setdefault("EXO_HOME", tempfile.mkdtemp(prefix="exo-spread-"))
    settings = load_settings()
    prepare_process(settings)
    limit_buffer_cache(settings.mlx_cache_bytes)
    loaded, config = load_for_serving(resolve_model(model), settings)
    if not keep_room:
        from exo.runner import loading

        loading.keep_cache_room = lambda: 0  # type: ignore[assignment]
    engine = ready_engine(loaded, config, settings)
    device = Device(settings.max_queue, max_batch=settings.max_batch)
    state = RunnerState("spread", pb.Shard(start_layer=0, end_layer=0, rank=0, world_size=1))
    state.ready(pb.ModelSummary(model_id="spread"), engine)
    socket = os.path.join(os.environ["EXO_HOME"], "runner.sock")
    child.server = start_server(socket, state, device, max_workers=settings.max_queue + 8,  # type: ignore[attr-defined]
                                stream_interval_s=settings.stream_interval_s)
    return engine


STAGES = ("plain", "served config", "cache bound", "process settings", "state room + batch warm-up", "prefix cache",
          "gRPC service", "cache cleared", "on another thread", "bound lifted", "switch interval 0.005", "plain again")


def staged_child(args: argparse.Namespace) -> None:
    """One process set up as ``runner_engine`` sets one up, step by step, decoding measured after each step (the
    median of ``--requests`` requests): a plain engine (``load``) first and last, between them the served engine
    (``load_for_serving``'s config, warmed up as ``ready_engine`` warms up) as each step of a runner's set-up joins."""
    import dataclasses
    import tempfile

    import mlx.core as mx

    from exo.engine import Engine, GenerationRequest, SamplingParams, load, resolve_model
    from exo.engine.bench import DEFAULT_PROMPTS, encode_prompt
    from exo.engine.kernel_warmup import warm_batches
    from exo.engine.memory import limit_buffer_cache
    from exo.runner.device import Device
    from exo.runner.loading import _kv_budget, attach_prefix_cache, load_for_serving, set_state_room
    from exo.runner.main import prepare_process
    from exo.runner.service import RunnerState, start_server
    from exo.settings import load_settings
    from exo.wire.proto_gen import node_pb2 as pb

    os.environ.setdefault("EXO_HOME", tempfile.mkdtemp(prefix="exo-spread-"))
    settings = load_settings()
    plain = load(args.model)
    plain.loaded = dataclasses.replace(plain.loaded, eos_token_ids=frozenset())
    prompts = [encode_prompt(plain, p, True) for p in DEFAULT_PROMPTS]

    def measure(engine: Engine) -> float:
        def decode(prompt: list[int]) -> float:
            request = GenerationRequest(prompt, max_tokens=args.max_tokens, sampling=SamplingParams(temperature=0),
                                        native_mtp="off")
            return engine.complete(request).stats.decode_tokens_per_s
        decode(prompts[0])  # (this stage's first request: warm)
        return statistics.median(decode(prompts[i % len(prompts)]) for i in range(args.requests))

    default_limit = mx.set_cache_limit(0)  # (MLX's own bound, to put back later; nothing is cached yet)
    mx.set_cache_limit(default_limit)
    tps: dict[str, float] = {"plain": measure(plain)}
    loaded, config = load_for_serving(resolve_model(args.model), settings)
    loaded = dataclasses.replace(loaded, eos_token_ids=frozenset())
    served = Engine(loaded, config)
    served.warmup()
    tps["served config"] = measure(served)
    limit_buffer_cache(settings.mlx_cache_bytes)
    tps["cache bound"] = measure(served)
    prepare_process(settings)
    tps["process settings"] = measure(served)
    set_state_room(served, settings)
    warm_batches(served, settings.max_batch, _kv_budget(settings))
    tps["state room + batch warm-up"] = measure(served)
    attach_prefix_cache(served, settings)
    tps["prefix cache"] = measure(served)
    device = Device(settings.max_queue, max_batch=settings.max_batch)
    state = RunnerState("spread", pb.Shard(start_layer=0, end_layer=0, rank=0, world_size=1))
    state.ready(pb.ModelSummary(model_id="spread"), served)
    socket = os.path.join(os.environ["EXO_HOME"], "runner.sock")
    server = start_server(socket, state, device, max_workers=settings.max_queue + 8,
                          stream_interval_s=settings.stream_interval_s)
    tps["gRPC service"] = measure(served)
    mx.clear_cache()
    tps["cache cleared"] = measure(served)
    box: list[float] = []  # decoding on a thread of its own, as a runner's device thread decodes
    thread = threading.Thread(target=lambda: box.append(measure(served)))
    thread.start()
    thread.join()
    tps["on another thread"] = box[0]
    mx.set_cache_limit(default_limit)
    tps["bound lifted"] = measure(served)
    sys.setswitchinterval(0.005)  # (Python's default)
    tps["switch interval 0.005"] = measure(served)
    tps["plain again"] = measure(plain)
    server.stop(0)
    print(json.dumps({"stages": tps, "cache_bytes": int(mx.get_cache_memory())}))


def child(args: argparse.Namespace) -> None:
    import dataclasses

    from exo.engine import GenerationRequest, SamplingParams, load
    from exo.engine.bench import DEFAULT_PROMPTS, encode_prompt

    if args.runner == "staged":
        staged_child(args)
        return
    started = time.perf_counter()
    if args.runner:
        engine = runner_engine(args.model, keep_room=args.runner == "keep")
    else:
        engine = load(args.model)
    engine.loaded = dataclasses.replace(engine.loaded, eos_token_ids=frozenset())
    prompts = [encode_prompt(engine, p, True) for p in DEFAULT_PROMPTS]

    def decode(prompt: list[int]) -> float:
        request = GenerationRequest(prompt, max_tokens=args.max_tokens, sampling=SamplingParams(temperature=0),
                                    native_mtp="off")
        return engine.complete(request).stats.decode_tokens_per_s

    for prompt in prompts[:2]:  # warm-up
        decode(prompt)
    ready = time.perf_counter() - started
    tps = [decode(prompts[i % len(prompts)]) for i in range(args.requests)]
    probe = host_probe()
    stat = Path("/proc/self/stat").read_text()
    last_cpu = int(stat[stat.rindex(")") + 2 :].split()[36])
    print(json.dumps({"tps": tps, "probe": probe, "ready_s": ready, "last_cpu": last_cpu, "threads": threads_cpu()[:4],
                      "affinity": sorted(os.sched_getaffinity(0))}))


def run(args: argparse.Namespace, report: dict) -> None:
    model_name = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                       if line.startswith("model name")), "?") if Path("/proc/cpuinfo").exists() else "?"
    allowed = sorted(os.sched_getaffinity(0))
    sib = siblings()
    smt = max(len(v) for v in sib.values())
    print(f"CPUs: {len(allowed)} allowed ({allowed[0]}-{allowed[-1]}), {model_name}, {smt} thread(s) a core; "
          f"load {os.getloadavg()[0]:.2f}")
    sets = {s: cpu_set(s, args.first_cpu) for s in args.settings}
    for s, cpus in sets.items():
        print(f"  setting {s}: {'not pinned' if cpus is None else cpus}")
    results: dict[str, list[dict]] = {s: [] for s in args.settings}
    staged: list[dict[str, float]] = []
    for p in range(args.processes):
        for s, cpus in sets.items():
            command = [sys.executable, __file__, args.model, "--child", "--max-tokens", str(args.max_tokens),
                       "--requests", str(args.requests),
                       *(["--runner", {"runner-full": "full", "runner-staged": "staged"}.get(s, "keep")] if s.startswith("runner") else [])]
            pin = (lambda cpus=cpus: os.sched_setaffinity(0, cpus)) if cpus is not None else None
            env = dict(os.environ)
            if s.startswith("hash="):  # not pinned, Python's hash seed fixed (str hashes, so set order, alike)
                env["PYTHONHASHSEED"] = s.removeprefix("hash=")
            out = subprocess.run(command, capture_output=True, text=True, preexec_fn=pin, check=False, env=env)
            if out.returncode != 0:
                print(f"  {s} #{p}: failed ({out.returncode}): {out.stderr[-2000:]}")
                continue
            got = json.loads(out.stdout.strip().splitlines()[-1])
            if "stages" in got:
                staged.append(got["stages"])
                print(f"  {s} #{p}: " + ", ".join(f"{k} {v:.1f}" for k, v in got["stages"].items())
                      + f" tok/s; MLX's cache at the end {got['cache_bytes'] / 2**20:.0f} MiB")
                continue
            results[s].append(got)
            busiest = ", ".join(f"{n} {t:.1f}s" for n, t in got["threads"])
            probe = got["probe"]
            print(f"  {s} #{p}: {statistics.median(got['tps']):.1f} tok/s ({', '.join(f'{t:.1f}' for t in got['tps'])}); "
                  f"host: python {probe['python_ms']:.1f} ms, 3k adds built {probe['build_ms']:.2f} ms, evaluated "
                  f"{probe['eval_ms']:.2f} ms, copy {probe['copy_gb_s']:.1f} GB/s; ready in {got['ready_s']:.1f} s; main thread last on CPU {got['last_cpu']}; busiest threads: {busiest}")
    print(f"{args.model}: plain decoding, {args.max_tokens} tokens x {args.requests} requests a process, "
          f"{args.processes} processes a setting (interleaved)")
    report.update(model=args.model, cpus=len(allowed), cpu_model=model_name, smt=smt, settings={})
    if staged:
        report["staged"] = staged
        print("  runner-staged, each step against the process's first plain engine (median over processes):")
        for stage in STAGES:
            ratios = [st[stage] / st["plain"] for st in staged if stage in st]
            print(f"    {stage:>28}: {statistics.median(ratios):.3f}x ({', '.join(f'{r:.3f}' for r in ratios)})")
    for s, got in results.items():
        medians = [statistics.median(g["tps"]) for g in got]
        if not medians:
            continue
        spread = max(medians) / min(medians)
        report["settings"][s] = {"cpus": sets[s], "process_medians": medians, "median": statistics.median(medians),
                                 "spread": spread}
        print(f"  {s:>8}: median {statistics.median(medians):.1f} tok/s; processes "
              f"{', '.join(f'{m:.1f}' for m in medians)}; spread {spread:.2f}x")


if __name__ == "__main__":
    main()
