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
