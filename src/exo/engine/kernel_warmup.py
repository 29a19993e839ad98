"""The products a batch will reach, run once at load, so that MLX CUDA compiles their kernels then, not mid-serving.

MLX CUDA compiles some kernels the first time a shape class needs them (NVRTC, at run time). Its quantized product
of 8 or more rows (``qmm_sm80``, MLX 0.32) is a CUTLASS kernel compiled per tile height: 16 rows up to 16 rows,
32 up to 32, 64 beyond (``make_cta_tiler``), and ``qmm_naive`` for layers whose outputs are not a multiple of 128;
the MoE experts' gathered product likewise. A server whose batch first grows past 7, 16 or 32 rows paid that compile
inside a step: every stream of the batch waited seconds (issue 51's stall after the one-client rows). One call of
each quantized layer shape at ``ROWS`` (one row count per tile), and of one MoE block at each, compiles them at
load, where the engine's warm-up already waits (MLX keeps the PTX under ``MLX_PTX_CACHE_DIR`` for later starts).

exo's quantized kernel (``kernels.cuda_qgemv``: calls of up to 32 rows, in launches of at most 8) is compiled per
row count of a launch, and MLX keeps no custom kernel's compile between processes: its layers run at 1-8 rows too.

Only on MLX CUDA: the CPU and Metal compile nothing at these points.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

ROWS = (8, 17, 33)  # one row count per tile height of MLX CUDA's tiled quantized product: 16, 32, 64
SHRINKS = 3  # members ``warm_batches`` takes out of a batch, a step after each


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def warm_products(modules: Sequence[nn.Module], *, force: bool = False) -> dict[str, float]:
    """Run every distinct quantized linear shape (an embedding's ``as_linear`` too) and one MoE block of each
    shape among ``modules``' leaves at each of ``ROWS`` rows, on zeros (a layer on exo's quantized kernel also at
    every row count of one launch). Returns seconds per kind (empty off
    MLX CUDA unless ``force``)."""
    if not (force or on_cuda()):
        return {}
    from .kernels.cuda_qgemv import MAX_ROWS
    from .models.layers import QGemvEmbedding, QGemvLinear, SparseMoeBlock

    # exo's quantized kernel is compiled per row count of a launch (1 to MAX_ROWS; longer calls go in launches of
    # MAX_ROWS and the rest) and MLX keeps no custom kernel's PTX between processes: every count, here
    qgemv_rows = tuple(sorted(set(ROWS) | set(range(1, MAX_ROWS + 1))))
    seen: set[tuple[Any, ...]] = set()
    calls: list[tuple[str, Any, int, mx.Dtype, tuple[int, ...]]] = []
    for tree in modules:
        for _, leaf in tree.named_modules():
            if isinstance(leaf, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and leaf.weight.ndim == 2:
                key = ("linear", type(leaf), tuple(leaf.weight.shape), leaf.bits, leaf.group_size, leaf.mode)
                if key not in seen:
                    seen.add(key)
                    width = leaf.weight.shape[1] * 32 // leaf.bits
                    fn = leaf.as_linear if isinstance(leaf, nn.QuantizedEmbedding) else leaf
                    own = isinstance(leaf, (QGemvLinear, QGemvEmbedding))
                    calls.append(("quantized products", fn, width, leaf.scales.dtype, qgemv_rows if own else ROWS))
            elif isinstance(leaf, SparseMoeBlock):
                gate = leaf.gates_fused if leaf.fused_inputs is not None else leaf.gate  # (models.fused_inputs)
                key = ("moe", tuple(gate.weight.shape), getattr(gate, "bits", None))
                if key not in seen:
                    seen.add(key)
                    width = gate.weight.shape[1] * 32 // gate.bits if hasattr(gate, "bits") else gate.weight.shape[1]
                    dtype = gate.scales.dtype if hasattr(gate, "scales") else gate.weight.dtype
                    calls.append(("moe blocks", leaf, width, dtype, ROWS))
    seconds: dict[str, float] = {}
    for kind, fn, width, dtype, row_counts in calls:
        start = time.perf_counter()
        for rows in row_counts:
            mx.eval(fn(mx.zeros((rows, 1, width), dtype=dtype)))
        seconds[kind] = seconds.get(kind, 0.0) + time.perf_counter() - start
    return seconds


def warm_batches(engine: Any, max_batch: int, budget_tokens: int | None = None, *, force: bool = False) -> float | None:
    """A batch grown from 2 to ``max_batch`` members on one engine, one plain step at every size (members of
    1-3 prompt tokens, so the batch's caches are padded as a server's are), then members taken out of its middle
    (``SHRINKS`` of them, a step after each), then dropped: the kernels MLX CUDA compiles for a batch compile at
    load, not inside a server's step. Issue 51's stall: the first time a machine served 8 clients, a step of 5-6
    members waited 4.9-5.1 s in ``mx.async_eval``, not on a second run there (MLX's PTX cache warm); the kernels
    new in that cache were MLX's gathers (bfloat16 along an axis, float32, int32 by int32 and by uint32 indices),
    which a batch reaches when a member leaves and its caches keep the other rows.

    The batch grows only as far as a server's would (``budget_tokens``: the instance's KV budget, ``batch_fits``
    with the engine's ``state_room``), and running out of memory here skips the rest of it (MLX's cache handed back,
    a warning): a load never fails for its warm-up. Seconds taken, or None where nothing runs: off MLX CUDA (unless
    ``force``), a batch of one, or a pipeline stage (its steps need every stage)."""
    if max_batch < 2 or not (force or on_cuda()) or engine.forward.stages > 1:
        return None
    from .batch import BatchLanes
    from .batch_memory import batch_fits
    from .memory import allocation_failed
    from .request import GenerationRequest

    if budget_tokens is not None:
        horizon = 3 + max_batch + 2  # a member's prompt and max_tokens below
        while max_batch > 1 and not batch_fits(engine, [horizon] * max_batch, budget_tokens):
            max_batch -= 1
        if max_batch < 2:
            return None
    start = time.perf_counter()
    batch = BatchLanes(engine)
    vocab = engine.vocab_size
    runs = []
    failed: RuntimeError | None = None
    try:
        for i in range(max_batch):
            prompt = [(7 + 31 * i + j) % vocab for j in range(1 + i % 3)]
            run = engine.start(GenerationRequest(prompt, max_tokens=max_batch + 2, native_mtp="off", ignore_eos=True))
            for _ in run.begin():
                pass
            batch.add(run)
            runs.append(run)
            if i:
                batch.step()
        for run in runs[1 : 1 + min(SHRINKS, max_batch - 1)]:
            batch.remove(run)
            batch.step()
    except RuntimeError as e:
        if not allocation_failed(e):
            raise
        failed = e
    finally:
        batch.drop()
    if failed is not None:
        mx.clear_cache()
        log.warning("warming up batches: the device ran out of memory at %d members (%s); the rest is skipped",
                    len(runs), failed)
    return time.perf_counter() - start
