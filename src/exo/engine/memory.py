"""A request that does not fit in the device's memory: MLX's allocation failure as a typed error.

MLX raises a plain ``RuntimeError`` from the evaluation that could not get a buffer: on CUDA
``cudaMalloc(...) failed: out of memory`` / ``cudaMallocAsync(...) failed: out of memory`` or ``[malloc]
Unable to allocate N bytes.`` (mlx/backend/cuda/allocator.cpp), on Metal ``[metal::malloc] ...`` or the same
``[malloc]`` line (mlx/backend/metal/allocator.cpp). (MLX's CPU backend does not check its ``malloc``: there a
failed allocation is not an exception.) The failed graph's buffers are freed as its arrays go; the cached
ones are handed back here, so the requests that fit run on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.core as mx

ALLOCATION_FAILURES = ("out of memory", "unable to allocate", "[metal::malloc]", "alloc_failed")

# MLX keeps the buffers a computation frees for the next one (its cache), by default up to its memory limit, which
# counts this process alone. A process serving an agent's turns needs buffers a little larger each turn (a prompt
# chunk's attention over a longer context): every turn's new sizes joined the cache and none left it. On an H200
# two servers of the 9B shape on one GPU (bench/agent_session.py: cache off and on side by side) grew until the
# second's allocation failed at turn 7 (2026-11-29). Bounded, the buffers past the bound go back to the device as
# they are freed, and a process holds what it computes with plus at most that much.
CUDA_CACHE_SHARE = 8  # on MLX CUDA: an eighth of the device's memory (an H200: ~17 GiB)
# At its bound MLX keeps no freed buffer: each goes back to the device as it is freed, and each new one is allocated
# anew (mlx/backend/cuda/allocator.cpp: ``free`` recycles only below the bound; a cached buffer serves a request up
# to twice its size, not a small one). Large buffers fill the bound (a prompt chunk's activations, the load's batch
# warm-up: 17,981 MiB in a runner on an H200 just after it) and MLX evicts them only under memory pressure; then
# every small buffer of every decode step (~700 a step at 9B) is allocated and freed on the device's allocator. So
# once the buffers kept pass half the bound, they all go back (``keep_cache_room``) and the cache refills with
# what is in use.
CACHE_ROOM_SHARE = 2  # the kept buffers are handed back once over 1 / CACHE_ROOM_SHARE of the bound
_bound: int | None = None  # what ``limit_buffer_cache`` set in this process (None: MLX's own default)


def device_memory_bytes() -> int:
    """The default device's memory (0: unknown). MLX names it ``memory_size`` on Metal and ``total_memory`` on
    CUDA (``mx.device_info``): read as ``memory_size`` alone, an H200 had none, and its runners' caches no bound."""
    info = mx.device_info()
    return int(info.get("memory_size") or info.get("total_memory") or 0)


def figures() -> dict[str, int]:
    """MLX's memory in this process: what arrays hold (``active_bytes``), the freed buffers it keeps for reuse
    (``cache_bytes``), the most arrays held at once since the process started (``peak_bytes``)."""
    return {"active_bytes": int(mx.get_active_memory()), "cache_bytes": int(mx.get_cache_memory()),
            "peak_bytes": int(mx.get_peak_memory())}


def limit_buffer_cache(limit_bytes: int | None = None) -> int | None:
    """Bound MLX's cache of freed buffers for this process (``EXO_MLX_CACHE_BYTES``): ``limit_bytes``, or by
    default on MLX CUDA an eighth of the device's memory (elsewhere MLX's default stays: unmeasured on Apple GPUs,
    where one runner per model is the rule). Returns the bound set (None: none set)."""
    global _bound
    if limit_bytes is None:
        if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
            return None
        total = device_memory_bytes()
        if not total:
            return None
        limit_bytes = total // CUDA_CACHE_SHARE
    mx.set_cache_limit(limit_bytes)
    _bound = limit_bytes
    return limit_bytes


def keep_cache_room() -> int:
    """Where ``limit_buffer_cache`` bounded MLX's cache in this process: once the freed buffers MLX keeps pass
    half the bound, every one goes back to the device (``mx.clear_cache``), so the next buffers kept are the ones
    steps use (``CACHE_ROOM_SHARE`` says why). The device thread calls it at every step of a batch and after a
    load's warm-ups. Returns the bytes handed back (0: nothing done)."""
    if _bound is None:
        return 0
    kept = mx.get_cache_memory()
    if kept * CACHE_ROOM_SHARE <= _bound:
        return 0
    mx.clear_cache()
    return kept


class DeviceMemoryError(RuntimeError):
    """The device ran out of memory for this request (an MLX allocation failed); other requests go on."""


def allocation_failed(error: BaseException) -> bool:
    """Whether ``error`` is MLX's allocation failure."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(marker in text for marker in ALLOCATION_FAILURES)


@contextlib.contextmanager
def out_of_memory(what: str) -> Iterator[None]:
    """Inside: MLX's allocation failure becomes a ``DeviceMemoryError`` saying what ran out (``what``) and
    what to do, with MLX's cache of free buffers handed back to the device."""
    try:
        yield
    except RuntimeError as e:
        if isinstance(e, DeviceMemoryError) or not allocation_failed(e):
            raise
        mx.clear_cache()
        raise DeviceMemoryError(
            f"the device ran out of memory {what} ({e}); send a shorter prompt, or lower EXO_PREFILL_CHUNK "
            "(the tokens one prefill step computes at once)"
        ) from e
