"""exo's quantized matrix-vector kernel (engine/kernels/cuda_qgemv.py) at every template it takes: 4 and 8 bits,
groups of 32/64/128, bfloat16 and float16 activations and scales, 1 to 8 rows (and so every outputs-per-warp), K
split over 1, 2 and 4 warps (run by scripts/cuda_jit_check.py)."""

import mlx.core as mx

from exo.engine.kernels import cuda_qgemv

cuda_qgemv.on_cuda = lambda: True
for bits in cuda_qgemv.BITS:
    for group in cuda_qgemv.GROUPS:
        for dtype in cuda_qgemv.DTYPES:
            for n in (8192, 2048, 32):  # split 1, 2 and 4 at K = 4096
                w, scales, biases = mx.quantize(mx.zeros((n, 4096), dtype=dtype), group_size=group, bits=bits)
                for rows in range(1, cuda_qgemv.MAX_ROWS + 1):
                    if n != 8192 and rows not in (1, 4):
                        continue
                    cuda_qgemv.qgemv(mx.zeros((rows, 4096), dtype=dtype), w, scales, biases, group_size=group,
                                     bits=bits)
