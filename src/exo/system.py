"""What a node has: memory (total, available), chip or CPU model, MLX backend, free disk, where it keeps compiled kernels.

Read from the OS without extra dependencies: /proc on Linux, sysctl and vm_stat on macOS, ``nvidia-smi`` for an MLX
CUDA node's GPU memory.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Memory:
    total_bytes: int
    available_bytes: int


def memory(budget: int | None = None) -> Memory:
    """The memory models get on this node: the machine's, or on an MLX CUDA node its GPU's (the one MLX runs on:
    the first of ``CUDA_VISIBLE_DEVICES``), whatever the host has; with a ``budget`` (``memory_budget_bytes``), at
    most that much of it."""
    mem = (_gpu_memory() if backend() == "cuda" else None) or _os_memory()
    if budget is None:
        return mem
    return Memory(min(mem.total_bytes, budget), min(mem.available_bytes, budget))


def _os_memory() -> Memory:
    if Path("/proc/meminfo").exists():
        values = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[name] = int(parts[0]) * 1024
        total = values.get("MemTotal", 0)
        return Memory(total, values.get("MemAvailable", values.get("MemFree", 0)))
    if platform.system() == "Darwin":
        total = int(_sysctl("hw.memsize") or 0)
        return Memory(total, _darwin_available(total))
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return Memory(pages * size, pages * size)


_GPU_MEMORY_TTL_S = 1.0  # node info is asked for by every peer poll and cluster view: one nvidia-smi a second at most
_gpu_memory_read: dict[tuple[str, str], tuple[float, Memory | None]] = {}


def _gpu_memory() -> Memory | None:
    """The memory of the GPU MLX CUDA runs on, from ``nvidia-smi`` (None: not readable), read at most once a
    second. Placement counts a model's weights and KV against it: on a 24 GB GPU in a 128 GB host, the host's
    memory would admit models the GPU cannot hold."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    now = time.monotonic()
    kept = _gpu_memory_read.get((smi, visible))
    if kept is not None and now - kept[0] < _GPU_MEMORY_TTL_S:
        return kept[1]
    mem = _read_gpu_memory(smi, visible)
    _gpu_memory_read[(smi, visible)] = (now, mem)
    return mem


def _read_gpu_memory(smi: str, visible: str) -> Memory | None:
    argv = [smi, "--query-gpu=memory.total,memory.free", "--format=csv,noheader,nounits"]
    if visible:
        argv += ["-i", visible]
    try:
        line = subprocess.run(argv, capture_output=True, text=True, timeout=5).stdout.strip().splitlines()[0]
        total, free = (int(float(v)) << 20 for v in line.split(","))  # MiB
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None
    return Memory(total, min(free, total)) if total > 0 else None


def _darwin_available(total: int) -> int:
    # Free + inactive + purgeable + speculative pages can be handed to a new process.
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=2).stdout
    except (OSError, subprocess.SubprocessError):
        return total
    page = int(m.group(1)) if (m := re.search(r"page size of (\d+) bytes", out)) else 16384
    pages = 0
    for key in ("Pages free", "Pages inactive", "Pages purgeable", "Pages speculative"):
        if m := re.search(rf"{key}:\s+(\d+)", out):
            pages += int(m.group(1))
    return min(total, pages * page) if pages else total


def _sysctl(name: str) -> str | None:
    try:
        out = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


@functools.cache
def chip() -> str:
    if platform.system() == "Darwin":
        return _sysctl("machdep.cpu.brand_string") or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def backend() -> str:
    """MLX's default device: metal, cuda or cpu."""
    import mlx.core as mx

    try:
        if mx.metal.is_available():
            return "metal"
    except AttributeError:
        pass
    try:
        if mx.cuda.is_available():
            return "cuda"
    except AttributeError:
        pass
    return "cpu"


def disk_free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


def kernel_dir() -> Path:
    """Where this machine keeps the kernels compiled for it (exo's CPU and CUDA kernels, MLX's PTX): ``EXO_KERNEL_DIR``,
    else ``$XDG_CACHE_HOME/exo/kernels`` (``~/.cache/exo/kernels``). Per machine, whatever the EXO_HOME."""
    if os.environ.get("EXO_KERNEL_DIR"):
        return Path(os.environ["EXO_KERNEL_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "exo" / "kernels"
