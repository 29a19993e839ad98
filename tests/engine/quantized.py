"""A random quantized linear layer for the tests of exo's quantized products (qgemv, padded rows, dense prompts)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def quantized_linear(n: int = 96, k: int = 128, bits: int = 4, group: int = 64, dtype: mx.Dtype = mx.float32,
                     key: mx.array | None = None) -> nn.QuantizedLinear:
    """``nn.QuantizedLinear`` of ``k`` inputs and ``n`` outputs from random weights (normal, scale 0.05)."""
    linear = nn.Linear(k, n, bias=False)
    key = mx.random.key(3) if key is None else key
    linear.weight = (mx.random.normal((n, k), key=key) * 0.05).astype(dtype)
    return nn.QuantizedLinear.from_linear(linear, group_size=group, bits=bits)
