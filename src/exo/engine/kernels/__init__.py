"""Kernels exo builds for the machine it runs on, where MLX's own are slow.

Three, for MLX's CPU backend on x86-64 with AVX2 (``cpu_linear.cpp``; AVX-512 where the CPU has it), where
MLX has no SIMD code:

- ``linear``: a bfloat16 ``x @ w.T``, bit-identical to MLX's product and several times faster on a decode
  step's linear layers (docs/performance.md, "The code's reasons": exo's CPU ``linear``); ``linear_packed`` the same product from w packed once
  (``pack_linear``) so that a call transposes nothing, what the engine's layers use; attention's two products
  run on ``linear`` too (``models.layers.cpu_attention``);
- ``silu``: ``nn.silu`` and mlx-lm's ``swiglu`` for bfloat16 as MLX's compiled kernels compute them (the same
  bits for every input), vectorised with FMA where MLX's call libm's ``fmaf`` per coefficient of its exp;
- ``gated_delta``: the GatedDeltaNet recurrence of mlx-lm's ``gated_delta_ops`` (its compiled step, row after
  row: ~10 dispatched ops per row and layer, so a prompt of T tokens costs T steps per layer) in one call,
  bit-identical.

On Apple silicon and on GPUs nothing here is used.

The extension is compiled on first use (about 10 s, once per machine and version: the C++ compiler, MLX's
headers from its wheel, nanobind's sources) into ``EXO_KERNEL_DIR`` (default ``~/.cache/exo/kernels``), under a
name that hashes everything that went into it, and loaded next to ``mlx.core`` in its nanobind domain. Before
it is used, its products are compared bit for bit with MLX's; any failure (no compiler, a build error, a
mismatch) leaves MLX's own kernels in place and says why in ``status()``. ``EXO_CPU_KERNELS=0`` turns it off.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from exo.system import kernel_dir  # noqa: F401  (where exo compiles its kernels: its CPU and CUDA ones)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_linear.cpp")
MODULE = "_exo_cpu_kernels"
FLAGS = ("-std=c++20", "-O3", "-fPIC", "-shared", "-fvisibility=hidden",
         # no FMA contraction: a product and its sum round as MLX's scalar loop rounds them
         "-ffp-contract=off", "-DNDEBUG", "-DNB_DOMAIN=mlx", "-DNB_COMPACT_ASSERTIONS")

Linear = Callable[[mx.array, mx.array], mx.array]
LinearPacked = Callable[[mx.array, mx.array, int], mx.array]
Silu = Callable[..., mx.array]
GatedDelta = Callable[..., tuple[mx.array, mx.array]]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _module() -> Any:
    with _lock:
        if "module" not in _state:
            module, reason = _load()
            _state["module"], _state["status"] = module, reason
            if module is None and reason and not reason.startswith(("off", "not ")):
                log.warning("exo: CPU kernels unavailable, using MLX's own (%s)", reason)
        return _state["module"]


def cpu_linear() -> Linear | None:
    """The CPU ``linear(x, w)`` kernel, built and checked on first call; None where it does not apply or
    could not be built (``status()`` says why)."""
    module = _module()
    return None if module is None else module.linear


def cpu_linear_packed() -> LinearPacked | None:
    """The CPU ``linear_packed(x, wp, n)`` kernel: ``linear(x, w)`` for ``wp = pack_linear(w)``, ``n = w.shape[0]``
    (no transposes of w per call, so faster than ``linear``, the same bits: docs/performance.md, "The code's reasons")."""
    module = _module()
    return None if module is None else module.linear_packed


def cpu_silu() -> Silu | None:
    """The CPU ``silu(a)`` / ``silu(a, b)`` kernel: ``nn.silu(a)`` / mlx-lm's ``swiglu(a, b)`` for bfloat16 as MLX's
    compiled kernels compute them (the same bits on every input), 8 values per AVX register with FMA."""
    module = _module()
    return None if module is None else module.silu


def pack_linear(w: mx.array) -> mx.array:
    """w [N, K] bfloat16 -> [ceil(N/16), ceil(K/2), 16] uint32 for ``linear_packed``: word j of lane i of block b
    holds w[16b + i, 2j] in its low half and w[16b + i, 2j + 1] in its high half, zeros past N and K. As big
    as w; a layer keeps it next to w (``models.layers.CpuLinear``)."""
    if w.ndim != 2 or w.dtype != mx.bfloat16:
        raise ValueError("pack_linear: w [N, K] bfloat16")
    n, k = w.shape
    with mx.stream(mx.cpu):
        padded = mx.pad(w.view(mx.uint16), [(0, -n % 16), (0, k % 2)])
        blocks, pairs = padded.shape[0] // 16, padded.shape[1] // 2
        lanes = padded.reshape(blocks, 16, pairs, 2).transpose(0, 2, 1, 3)
        return mx.contiguous(lanes).reshape(blocks, pairs, 32).view(mx.uint32)


def cpu_gated_delta() -> GatedDelta | None:
    """The CPU ``gated_delta(q, k, v, g, beta, state, mask)`` kernel (see ``cpu_linear``)."""
    module = _module()
    return None if module is None else module.gated_delta


def status() -> str:
    """``built``, or why the kernels are not in use."""
    _module()
    return str(_state["status"])


ISAS = ("avx2", "avx512")


def isa() -> str:
    """The instruction set the kernels are built for: ``avx512`` where the CPU has AVX-512F (16 outputs per
    register), else ``avx2``; ``EXO_CPU_KERNELS_ISA`` chooses (``avx2`` on any machine, ``avx512`` only
    where the CPU has it). The values are the same bits either way."""
    chosen = os.environ.get("EXO_CPU_KERNELS_ISA", "").strip().lower()
    if chosen and chosen not in ISAS:
        raise ValueError(f"EXO_CPU_KERNELS_ISA={chosen!r}: choose one of {', '.join(ISAS)}")
    if chosen == "avx2":
        return chosen
    return "avx512" if " avx512f " in _cpu_flags() else "avx2"


def _cpu_flags() -> str:
    try:
        line = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        line = ""
    return line + " "


def _flags(chosen: str) -> tuple[str, ...]:
    # FMA: silu's exp computes as MLX's with fused multiply-adds (libm's fmaf there)
    return (*FLAGS, "-mavx2", "-mfma", *(("-mavx512f",) if chosen == "avx512" else ()))


def _applies() -> str | None:
    if os.environ.get("EXO_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "off (EXO_CPU_KERNELS=0)"
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return "not an x86-64 Linux machine (MLX's own CPU kernels apply)"
    if " avx2 " not in _cpu_flags() or " fma " not in _cpu_flags():
        return "not a CPU with AVX2 and FMA"
    try:
        isa()
    except ValueError as e:
        return str(e)
    return None


def _load() -> tuple[Any, str]:
    reason = _applies()
    if reason:
        return None, reason
    flags = _flags(isa())
    try:
        import nanobind
    except ImportError:
        return None, "nanobind is not installed"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler or not shutil.which(compiler):
        return None, "no C++ compiler (install g++, or set CXX)"
    mlx_dir = Path(importlib.util.find_spec("mlx").submodule_search_locations[0])  # type: ignore[union-attr,index]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), mx.__version__.encode(), nanobind.__version__.encode(),
                 suffix.encode(), " ".join(flags).encode(), compiler.encode()):
        key.update(part + b"\0")
    directory = kernel_dir() / key.hexdigest()[:16]
    target = directory / (MODULE + suffix)
    failed = directory / "build-failed.txt"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(directory / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one build per machine: other processes wait, then load it
            if failed.exists():
                return None, f"an earlier build failed: {_first_error(failed.read_text())} ({failed}: delete it to retry)"
            if not target.exists():
                error = _build(compiler, flags, nanobind, mlx_dir, target)
                if error:
                    failed.write_text(error)
                    return None, f"the build failed: {_first_error(error)} ({failed}: delete it to retry)"
    except OSError as e:
        return None, f"{directory}: {e}"
    try:
        spec = importlib.util.spec_from_file_location(MODULE, target)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        mismatch = (_check(module.linear) or _check(lambda x, w: module.linear_packed(x, pack_linear(w), w.shape[0]))
                    or _check_gated_delta(module.gated_delta) or _check_silu(module.silu))
    except Exception as e:  # a module built against another MLX/nanobind ABI fails here, not later
        return None, f"{target} does not load: {e}"
    if mismatch:
        return None, mismatch
    return module, "built"


def _build(compiler: str, flags: tuple[str, ...], nanobind, mlx_dir: Path, target: Path) -> str | None:
    log.warning("exo: building the CPU kernels for this machine (once, about 10 s) into %s", target.parent)
    nb = Path(nanobind.source_dir()).parent
    include = sysconfig.get_paths()["include"]
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    command = [compiler, *flags, f"-I{mlx_dir / 'include'}", f"-I{nanobind.include_dir()}",
               f"-I{nb / 'ext' / 'robin_map' / 'include'}", f"-I{include}", str(SOURCE),
               str(Path(nanobind.source_dir()) / "nb_combined.cpp"), f"-L{mlx_dir / 'lib'}", "-lmlx",
               f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(tmp)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{' '.join(command)}\n{e}"
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        return f"{' '.join(command)}\n{done.stderr[-4000:]}"
    os.replace(tmp, target)
    return None


def _first_error(log: str) -> str:
    """The compiler's first error line (a missing Python.h: install python3-dev), else the log's last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "no output")[:300]


def _check(linear: Linear) -> str | None:
    """Bit-for-bit against MLX's matmul on shapes that reach every path of the kernel."""
    key = mx.random.key(7)
    for m, n, k in ((1, 24, 40), (5, 37, 19), (9, 16, 64), (13, 70, 33)):
        kx, kw, key = mx.random.split(key, 3)
        x = mx.random.normal((m, k), key=kx).astype(mx.bfloat16)
        w = (mx.random.normal((n, k), key=kw) * 0.1).astype(mx.bfloat16)
        with mx.stream(mx.cpu):
            want, got = x @ w.T, linear(x, w)
            same = mx.array_equal(want.view(mx.uint16), got.view(mx.uint16)).item()
        if not same:
            return f"its products differ from MLX's at [{m}, {k}] x [{n}, {k}]"
    return None


def every_bfloat16() -> mx.array:
    """The 65536 bfloat16 values, by bits (NaNs, infinities, signed zeros, subnormals included)."""
    return mx.arange(0, 65536, dtype=mx.uint32).astype(mx.uint16).view(mx.bfloat16)


def _check_silu(silu: Silu) -> str | None:
    """Bit-for-bit against ``nn.silu`` and mlx-lm's ``swiglu`` on every bfloat16 input."""
    import mlx.nn as nn
    from mlx_lm.models.activations import swiglu

    a = every_bfloat16()
    b = mx.random.normal(a.shape, key=mx.random.key(13)).astype(mx.bfloat16)
    with mx.stream(mx.cpu):
        if not bits_equal(silu(a), nn.silu(a)):
            return "its silu differs from MLX's"
        if not bits_equal(silu(a, b), swiglu(a, b)):
            return "its swiglu differs from mlx-lm's"
    return None


def relative_error(got: mx.array, want: mx.array) -> float:
    """The largest |got - want| over the largest |want| (float32): the load-time checks' distance."""
    want = want.astype(mx.float32)
    return float((mx.abs(got.astype(mx.float32) - want).max() / mx.maximum(mx.abs(want).max(), 1e-30)).item())


def cuda_conversions(namespace: str) -> str:
    """CUDA source for a ``cuda_kernel``'s header: ``to_float`` / ``from_float`` for float, bfloat16 and half, in
    ``namespace`` (exo's CUDA kernels share them)."""
    return f"""
namespace {namespace} {{

template <typename T> __device__ __forceinline__ float to_float(T v) {{ return static_cast<float>(v); }}
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {{ return __bfloat162float(v); }}
template <> __device__ __forceinline__ float to_float<__half>(__half v) {{ return __half2float(v); }}

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {{ return __float2bfloat16_rn(v); }}
template <> __device__ __forceinline__ __half from_float<__half>(float v) {{ return __float2half_rn(v); }}
"""


def bits_equal(a: mx.array, b: mx.array) -> bool:
    """Same dtype, shape and bits (a -0 is not a +0, a NaN equals its own bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {2: mx.uint16, 4: mx.uint32}.get(a.dtype.size)
    return bool(mx.array_equal(a.view(view), b.view(view)).item()) if view else bool(mx.array_equal(a, b).item())


def gated_delta_inputs(key: mx.array, b: int, t: int, hk: int, hv: int, dk: int, dv: int, dtype=mx.bfloat16):
    """Random inputs of the GatedDeltaNet recurrence as a layer computes them (q and k L2-normalised, g the
    decay in (0, 1), beta a sigmoid): q, k, v, g, beta, state."""
    kq, kk, kv, kg, kb, ks = mx.random.split(key, 6)
    q = mx.random.normal((b, t, hk, dk), key=kq)
    k = mx.random.normal((b, t, hk, dk), key=kk)
    q = (q / mx.linalg.norm(q, axis=-1, keepdims=True) / dk**0.5).astype(dtype)
    k = (k / mx.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = mx.random.normal((b, t, hv, dv), key=kv).astype(dtype)
    g = mx.exp(-mx.random.uniform(0.0, 2.0, (b, t, hv), key=kg))
    beta = mx.sigmoid(mx.random.normal((b, t, hv), key=kb).astype(dtype))
    state = mx.random.normal((b, hv, dv, dk), key=ks) * 0.1
    return q, k, v, g, beta, state


def _check_gated_delta(gated_delta: GatedDelta) -> str | None:
    """Bit-for-bit against mlx-lm's ``gated_delta_ops`` on shapes that reach every path of the kernel."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    key = mx.random.key(11)
    for b, t, hk, hv, dk, dv, masked in ((2, 3, 1, 2, 16, 8, False), (1, 2, 2, 2, 12, 11, True)):
        k0, key = mx.random.split(key)
        args = gated_delta_inputs(k0, b, t, hk, hv, dk, dv)
        mask = (mx.arange(t)[None] >= mx.arange(b)[:, None]) if masked else None
        with mx.stream(mx.cpu):
            want, got = gated_delta_ops(*args, mask), gated_delta(*args, mask)
            same = all(bits_equal(w, g_) for w, g_ in zip(want, got, strict=True))
        if not same:
            return f"its gated delta rule differs from mlx-lm's at B={b} T={t} Hk={hk} Hv={hv} Dk={dk} Dv={dv}"
    return None
