"""Quantized linear layers whose calls of fewer than ``pad`` rows are padded with zero rows to ``pad``.

MLX CUDA computes a quantized product of 1-7 rows with ``qmv``, which reads the weights once per row: a verify
call of K + 1 rows pays K + 1 reads of every linear layer, most of a native-MTP round's cost at 9B on an H200
(docs/performance.md, the H200 round costs). From 8 rows on it takes a tiled kernel, which read the 9B's large
layers faster for 8 rows than ``qmv`` for one. Where that kernel gives each row the same bits whatever rows are
beside it, a decode step (1 row), a verify call (K + 1 rows) and a small batch step padded alike to ``pad`` rows
agree row for row by construction, each at the cost of one tiled call.

``use_padded_rows`` (the loader; off by default: ``EXO_PAD_ROWS=8`` on MLX CUDA, ``always:8`` on any device for
the tests) checks each distinct shape on this device before it pads it (``check``): the rows of a padded call must
not depend on their companions, and the padded call must cost at most ``MAX_COST`` one-row calls (a tiny layer,
a few dozen outputs, is faster through ``qmv``: it keeps MLX's product, whose 1-7 rows agree with its one row).
Plain decoding then rounds otherwise than stock mlx-lm on every padded shape (docs/architecture.md names it).
``bench/qmm_rows.py`` measures the same two things per shape, apart from the engine.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

MAX_COST = 1.1  # a padded call may cost this many one-row calls (timed at load, medians)
TRIALS = 2  # random companions per row count in the check


def setting() -> tuple[str, int]:
    """``EXO_PAD_ROWS``: ("off", 0) by default; ``8`` -> ("cuda", 8): on MLX CUDA; ``always:8`` -> ("always", 8)."""
    value = os.environ.get("EXO_PAD_ROWS", "0").strip().lower()
    where, _, rows = value.rpartition(":")
    try:
        pad = int(rows)
    except ValueError as error:
        raise ValueError(f"EXO_PAD_ROWS must be 0, a row count (8) or always:<rows>, not {value!r}") from error
    if pad <= 1:
        return "off", 0
    if where not in ("", "always"):
        raise ValueError(f"EXO_PAD_ROWS must be 0, a row count (8) or always:<rows>, not {value!r}")
    return ("always" if where else "cuda"), pad


def on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


class PaddedRowsLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose calls of fewer than ``pad`` rows run as ``pad`` rows (zeros after them)."""

    pad = 8

    def __call__(self, x: mx.array) -> mx.array:
        k = x.shape[-1]
        rows = x.size // k if k else 0
        if not 0 < rows < self.pad:
            return super().__call__(x)
        flat = mx.concatenate([x.reshape(rows, k), mx.zeros((self.pad - rows, k), dtype=x.dtype)])
        return super().__call__(flat)[:rows].reshape(*x.shape[:-1], -1)


def check(module: nn.QuantizedLinear, pad: int, *, timed: bool = True) -> tuple[bool, str]:
    """Whether ``module``'s shape pads on this device: (ok, what was found)."""
    k = module.weight.shape[1] * 32 // module.bits
    dtype = module.scales.dtype
    keys = iter(mx.random.split(mx.random.key(7), 2 + pad * TRIALS))
    x = (mx.random.normal((pad, k), key=next(keys)) * 0.5).astype(dtype)
    product = nn.QuantizedLinear.__call__
    for rows in range(1, pad + 1):
        zeros = product(module, mx.concatenate([x[:rows], mx.zeros((pad - rows, k), dtype=dtype)]))[:rows]
        for _ in range(TRIALS if rows < pad else 0):
            other = (mx.random.normal((pad - rows, k), key=next(keys)) * 0.5).astype(dtype)
            beside = product(module, mx.concatenate([x[:rows], other]))[:rows]
            if not mx.array_equal(zeros, beside).item():
                return False, f"a row's bits change with the rows beside it ({rows} of {pad})"
    if not timed:
        return True, "rows independent of their companions"
    one, padded = _seconds(module, x[:1]), _seconds(module, x)
    cost = padded / one
    if cost > MAX_COST:
        return False, f"a padded call costs {cost:.2f} one-row calls"
    return True, f"rows independent of their companions; a padded call costs {cost:.2f} one-row calls"


def _seconds(module: nn.QuantizedLinear, x: mx.array, calls: int = 10, repeats: int = 5) -> float:
    xs = [x + 0 for _ in range(calls)]
    mx.eval(xs, nn.QuantizedLinear.__call__(module, x))
    times = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval([nn.QuantizedLinear.__call__(module, v) for v in xs])
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def use_padded_rows(modules: Sequence[nn.Module]) -> dict[str, str]:
    """Give the plain quantized linear layers of ``modules`` (a backbone, the MTP head) ``PaddedRowsLinear`` for
    each distinct shape that passes ``check`` here. Returns what was found per shape (``"pad 8: 4096->12288 4-bit
    g64"`` -> ``"ok: ..."`` or ``"not used: ..."``); nothing unless ``EXO_PAD_ROWS`` opts in."""
    where, pad = setting()
    if where == "off" or (where == "cuda" and not on_cuda()):
        return {}
    shapes: dict[tuple[Any, ...], list[nn.QuantizedLinear]] = {}
    for tree in modules:
        for _, leaf in tree.named_modules():
            if type(leaf) is nn.QuantizedLinear and leaf.weight.ndim == 2:
                signature = (tuple(leaf.weight.shape), leaf.bits, leaf.group_size, leaf.mode)
                shapes.setdefault(signature, []).append(leaf)
    found: dict[str, str] = {}
    for (shape, bits, group, _), leaves in shapes.items():
        name = f"pad {pad}: {shape[1] * 32 // bits}->{shape[0]} {bits}-bit g{group}"
        passed, what = check(leaves[0], pad, timed=where == "cuda")
        found[name] = ("ok: " if passed else "not used: ") + what
        if passed:
            for leaf in leaves:
                leaf.__class__ = PaddedRowsLinear
                leaf.pad = pad
    return found
