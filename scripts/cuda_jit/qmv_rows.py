"""The multi-row quantized kernel (engine/kernels/cuda_qmv.py) at every template it takes: 4 and 8 bits, groups of
32/64/128, with and without a partial tail of K (run by scripts/cuda_jit_check.py)."""

import mlx.core as mx

from exo.engine.kernels import cuda_qmv

cuda_qmv.on_cuda = lambda: True
for bits in cuda_qmv.BITS:
    for group in cuda_qmv.GROUPS:
        for k in (4096, 4096 + group):  # whole lane steps, and a tail
            w, scales, biases = mx.quantize(mx.zeros((64, k), dtype=mx.bfloat16), group_size=group, bits=bits)
            cuda_qmv.qmv_rows(mx.zeros((3, k), dtype=mx.bfloat16), w, scales, biases, group_size=group, bits=bits)
