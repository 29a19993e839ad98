"""exo: distributed LLM inference on MLX with native multi-token-prediction speculative decoding."""

import os

__version__ = "0.1.0"

# On MLX's CUDA backend, attention over more than one query row goes through cuDNN, which builds an
# execution plan for every new key length: ~50 ms for each speculative verify call (measured on an
# H200; bench/results/h200-mlx-cuda-round-anatomy.txt). MLX's own kernels have no such cost. Set before
# MLX first reads it; a value the user sets wins.
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
# MLX CUDA multiplies float32 matrices in TF32 (10-bit mantissas) unless told not to. The chunked GatedDeltaNet
# prefill (engine/models/gated_delta_chunked.py) carries the recurrent state through float32 products, the
# only float32 matmuls of a bfloat16 or quantized model; TF32 would round them ~1000x coarser than the token
# loop it replaces. Their cost is small either way. A value the user sets wins.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
