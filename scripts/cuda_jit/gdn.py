"""exo's GatedDeltaNet step kernel (engine/kernels/cuda_gdn.py) at the templates real models take: 1 to 8 rows,
Qwen3.5-9B's / 35B-A3B's heads (16 x 128 keys, 32 x 128 values), 27B's (48 value heads), the test fixtures' (32-wide
heads), bfloat16 and float16, a + dt_bias in the activations' type or float32 (run by scripts/cuda_jit_check.py)."""

from types import SimpleNamespace

import mlx.core as mx

from exo.engine.kernels import cuda_gdn

cuda_gdn.on_cuda = lambda: True
for hk, hv, dk, dv in ((16, 32, 128, 128), (16, 48, 128, 128), (2, 4, 32, 32)):
    for dtype in cuda_gdn.DTYPES:
        for bias_dtype in (dtype, mx.float32):
            conv_dim = 2 * hk * dk + hv * dv
            layer = SimpleNamespace(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, conv_kernel_size=4,
                                    conv1d=SimpleNamespace(weight=mx.zeros((conv_dim, 4, 1), dtype=dtype)),
                                    A_log=mx.zeros((hv,), dtype=bias_dtype), dt_bias=mx.zeros((hv,), dtype=bias_dtype))
            for rows in range(1, cuda_gdn.MAX_ROWS + 1):
                if (hk, hv) != (16, 32) and rows not in (1, 4):
                    continue
                cuda_gdn.gdn_rows(layer, mx.zeros((1, 3, conv_dim), dtype=dtype), mx.zeros((1, rows, conv_dim), dtype=dtype),
                                  mx.zeros((1, rows, hv), dtype=dtype), mx.zeros((1, rows, hv), dtype=dtype),
                                  mx.zeros((1, hv, dv, dk), dtype=mx.float32))
