"""What the benchmarks share: their command-line shape and starting `exo serve` as users run it.

Every benchmark takes ``MODEL`` (a card id, repo id or checkpoint directory; default exo-demo),
``--repeats N`` (configurations alternate within each repeat, so a slow moment of a shared machine hits all
of them: ratios are measured in one run), ``--device cpu|gpu`` (MLX's device for what runs in this process;
default: MLX's default, the GPU where there is one) and ``--json`` (the report as one JSON object on stdout;
the human-readable table goes to stderr instead).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"


def add_common_arguments(parser: argparse.ArgumentParser, *, repeats: int, model: bool = True,
                         device: bool = True) -> None:
    if model:
        parser.add_argument("model", nargs="?", default="exo-demo",
                            help="card id, Hugging Face repo id or checkpoint directory (default: exo-demo)")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help=f"rounds of every configuration, alternating (default {repeats})")
    if device:
        parser.add_argument("--device", choices=("cpu", "gpu"), default=None,
                            help="MLX's device for this process (default: MLX's default)")
    parser.add_argument("--json", action="store_true",
                        help="print the report as one JSON object on stdout (the table goes to stderr)")


def stop_on_signals() -> None:
    """SIGTERM and SIGHUP end the benchmark as Ctrl-C does, by an exception: its ``finally`` blocks run and end the
    processes it started (a pipeline's stages, a tensor group's members, ``exo serve``) and remove their
    folders. Python's default ends the process at once, leaving them running."""

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


def use_device(name: str | None) -> None:
    if name is not None:
        import mlx.core as mx

        device = mx.cpu if name == "cpu" else mx.gpu
        if not mx.is_available(device):
            raise SystemExit(f"--device {name}: this machine's MLX has no {name.upper()} backend")
        mx.set_default_device(device)


@contextlib.contextmanager
def report_to(as_json: bool) -> Iterator[dict[str, Any]]:
    """The block fills the yielded dict; with ``as_json`` its prints go to stderr and the dict to stdout."""
    report: dict[str, Any] = {}
    if not as_json:
        yield report
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield report
    json.dump(report, sys.stdout, indent=1, default=str)
    sys.stdout.write("\n")


def free_port() -> int:
    from exo.runner.group import free_port as _free

    return _free()


# MLX CUDA's compiled kernels for every server a benchmark starts (a runner keeps them under its EXO_HOME otherwise:
# each fresh home compiled the 9B's kernels again, ~4 minutes before the server answered on an H200). A value set
# outside wins; off MLX CUDA nothing reads it.
BENCH_PTX_CACHE = os.path.join(tempfile.gettempdir(), "exo-bench-mlx-ptx")


def start_server(model: str | None, port: int, grpc_port: int, peers: str | None = None,
                 home: str | None = None) -> subprocess.Popen:
    """`exo serve` (this checkout's) on 127.0.0.1, discovery off, once its /health answers. Its log (stderr, the
    runners' lines included) goes to a file, ``process.log_path`` (a pipe nobody reads would stop the daemon once
    its 64 KiB filled): ``server_log_lines`` reads it."""
    import aiohttp

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    env.pop("EXO_API_KEY", None)
    if home is not None:
        env["EXO_HOME"] = home
    env.setdefault("MLX_PTX_CACHE_DIR", BENCH_PTX_CACHE)
    argv = [sys.executable, "-m", "exo.cli.main", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--grpc-port", str(grpc_port), "--no-discovery"]
    argv += ["--model", model] if model is not None else []
    argv += ["--peers", peers] if peers is not None else []
    log_fd, log_path = tempfile.mkstemp(prefix="exo-serve-", suffix=".log")
    process = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log_fd, text=True)
    os.close(log_fd)
    process.log_path = log_path  # type: ignore[attr-defined]

    async def wait() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(600):
                if process.poll() is not None:
                    raise RuntimeError(f"exo serve exited: {Path(log_path).read_text()[-6000:]}")
                try:
                    async with session.get(f"http://127.0.0.1:{port}/health") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError("exo serve did not come up")

    try:
        asyncio.run(wait())
    except BaseException:  # not up: the caller has no handle on it to stop it
        process.kill()
        process.wait(30)
        raise
    return process


def server_log_lines(process: subprocess.Popen, *needles: str) -> list[str]:
    """The lines of a server's log (``start_server``) that hold any of ``needles``."""
    path = getattr(process, "log_path", None)
    if path is None or not os.path.exists(path):
        return []
    with open(path, errors="replace") as f:
        return [line.rstrip("\n") for line in f if any(n in line for n in needles)]


def device_trace(folder: str | None, start: float, end: float) -> dict[str, Any] | None:
    """What the runners' device threads did between ``start`` and ``end`` (``time.monotonic()``), from the
    lines ``EXO_DEVICE_TRACE=folder`` makes them write (``runner.device.DeviceTrace``): steps of a batch, their
    phases' seconds and the longest stretch between two decode steps while members waited (a stall shows
    there). None without a trace."""
    if folder is None:
        return None
    lines = []
    for path in Path(folder).glob("device-*.jsonl"):
        for raw in path.read_text().splitlines():
            try:
                line = json.loads(raw)
            except ValueError:  # a line cut short by a runner still writing
                continue
            if start <= line["t"] <= end:
                lines.append(line)
    if not lines:
        return {"steps": 0}
    lines.sort(key=lambda line: line["t"])
    decode = [line for line in lines if line.get("stepped")]
    gaps = [b["t"] - a["t"] for a, b in zip(decode, decode[1:], strict=False)]
    seconds = {phase: sum(line.get(phase, 0.0) for line in lines) for phase in ("room", "plan", "prefill", "step", "emit")}
    window = end - start
    steps = sorted(line["step"] for line in decode)
    return {
        "steps": len(decode), "steps_per_s": len(decode) / window,
        "mean_batch": sum(line["stepped"] for line in decode) / max(1, len(decode)),
        "step_ms_p50": 1000 * steps[len(steps) // 2] if steps else 0.0,
        "step_ms_max": 1000 * steps[-1] if steps else 0.0,
        "prefill_ms_max": 1000 * max((line.get("prefill", 0.0) for line in lines), default=0.0),
        "longest_gap_s": max(gaps, default=0.0),
        "prefill_tokens": sum(line.get("prefill_tokens", 0) for line in lines),
        "handed_back": sum(1 for line in lines if line.get("handed_back")),  # steps that handed MLX's cache back
        "shared_prefills": sum(1 for line in lines if line.get("together")),
        "share": {**{phase: s / window for phase, s in seconds.items()}, "idle": max(0.0, 1 - sum(seconds.values()) / window)},
        # the longest step that ran past the trace's stall threshold: where its thread was (runner.trace)
        "stall": max(({"seconds": sum(line.get(p, 0.0) for p in ("room", "plan", "prefill", "step", "emit")),
                       "stack": line["stall_stack"], **{k: line.get(k) for k in ("members", "admitted", "prefill_tokens")}}
                      for line in lines if line.get("stall_stack")), key=lambda s: s["seconds"], default=None),
    }


def device_profile(folder: str | None, start: float, end: float, top: int) -> str:
    """The ``top`` functions by own time of the runners' device threads between ``start`` and ``end``
    (``time.monotonic()``), from the per-second cProfile files ``EXO_DEVICE_PROFILE=folder`` makes them write
    (``runner.trace.DeviceTrace``); "" without any."""
    import io
    import pstats

    if folder is None:
        return ""
    paths = [str(p) for p in Path(folder).glob("profile-*.pstats")
             if int(start) <= int(p.stem.split("-")[2]) <= end]
    if not paths:
        return ""
    text = io.StringIO()
    stats = pstats.Stats(*paths, stream=text)
    stats.sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()  # from the totals on (not the list of files read)
    first = next((i for i, line in enumerate(lines) if "function calls" in line), 0)
    return "\n".join(line.replace(str(Path.cwd()) + "/", "") for line in lines[first:]).strip()


def format_trace(t: dict[str, Any] | None) -> str:
    if not t:
        return ""
    if not t["steps"]:
        return "device: no decode step"
    share = " ".join(f"{k} {100 * v:.0f}%" for k, v in t["share"].items())
    return (f"device: {t['steps']} steps ({t['steps_per_s']:.1f}/s, batch {t['mean_batch']:.1f}, step p50 "
            f"{t['step_ms_p50']:.1f} ms, max {t['step_ms_max']:.0f} ms), longest gap between steps "
            f"{t['longest_gap_s']:.2f} s, {t['prefill_tokens']} prompt tokens ({t['shared_prefills']} shared calls, "
            f"a step's prefill at most {t['prefill_ms_max']:.0f} ms, MLX's cache handed back at {t['handed_back']} "
            f"steps); time: {share}"
            + (f"\n    longest stall {t['stall']['seconds']:.2f} s (members {t['stall']['members']}, admitted "
               f"{t['stall']['admitted']}, prompt tokens {t['stall']['prefill_tokens']}), the device thread in it:\n      "
               + "\n      ".join(frame.replace(str(Path.cwd()) + "/", "") for frame in t["stall"]["stack"])
               if t.get("stall") else ""))


# -- MLX CUDA's code paths without a GPU ----------------------------------------------------------------------
# MLX CUDA's code paths on a machine without a GPU, for the host's cost of building graphs (``build_profile.py
# --emulate-cuda``): exo's kernels installed as the loader installs them on MLX CUDA (their load-time checks taken as
# passed), compiled for sm_90 by NVRTC (the dev install's wheel on Linux x86-64), and every launch
# stubbed (``mx.fast.precompiled_cuda_kernel`` returns zeros of the outputs' shapes, unevaluated, that depend on its
# inputs). The Python that
# builds a step then is the GPU's, op for op; what MLX's own launch costs on the GPU (converting the arguments,
# copying the binary into the primitive, the launch at evaluation) is not here. Never part of exo itself.


def add_emulate_argument(parser: argparse.ArgumentParser) -> None:
    """``--emulate-cuda`` (the script then calls ``emulate_cuda`` before it loads the model)."""
    parser.add_argument("--emulate-cuda", action="store_true",
                        help="on a machine without a GPU, MLX CUDA's code paths with exo's launches stubbed "
                             "(bench/common.py emulate_cuda: builds only)")


def emulate_cuda() -> None:
    """Install the emulation (before the model is loaded: the loader decides the kernels)."""
    import mlx.core as mx

    from exo.engine.kernels import cuda_attn, cuda_build, cuda_gdn, cuda_qgemv

    cuda_qgemv.on_cuda = lambda: True
    cuda_qgemv.on_cuda_device = lambda: True
    cuda_gdn.on_cuda = lambda: True
    cuda_attn.on_cuda = lambda: True
    for module in (cuda_qgemv, cuda_gdn, cuda_attn):
        module.check = lambda *a, **k: (True, "emulated")  # type: ignore[attr-defined]
    cuda_gdn.check_prompt = lambda *a, **k: (True, "emulated")
    cuda_build.device_architecture = lambda: (9, 0)

    def launch(*, name: str, compiled_source: bytes, inputs: Any, output_shapes: Any, output_dtypes: Any,
               scalars: Any, grid: Any, threadgroup: Any, init_value: Any = None, ensure_row_contiguous: bool = True,
               stream: Any = None) -> list[mx.array]:
        outputs = [mx.zeros(tuple(s), dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        # outputs that depend on the launch's inputs, as the kernel's do: a compiled function traced through it
        # (bench/compiled_step.py) keeps the graph that feeds it rather than pruning it as unused
        return mx.depends(outputs, [a for a in inputs if isinstance(a, mx.array)])

    mx.fast.precompiled_cuda_kernel = launch
