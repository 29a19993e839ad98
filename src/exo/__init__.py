"""exo: distributed LLM inference on MLX with native multi-token-prediction speculative decoding."""

import os
import sys

__version__ = "0.1.0"

# On MLX's CUDA backend, attention over more than one query row goes through cuDNN, which builds an
# execution plan for every new key length, paid again by every speculative verify call (docs/performance.md, "The code's reasons":
# ``MLX_CUDA_USE_CUDNN_SDPA=0``). MLX's own kernels have no such cost. Set before
# MLX first reads it; a value the user sets wins.
os.environ.setdefault("MLX_CUDA_USE_CUDNN_SDPA", "0")
# MLX CUDA multiplies float32 matrices in TF32 (10-bit mantissas) unless told not to. The chunked GatedDeltaNet
# prefill (engine/models/gated_delta_chunked.py) carries the recurrent state through float32 products, the
# only float32 matmuls of a bfloat16 or quantized model; TF32 would round them ~1000x coarser than the token
# loop it replaces. Their cost is small either way. A value the user sets wins.
os.environ.setdefault("MLX_ENABLE_TF32", "0")


def without_torch() -> None:
    """For exo's own processes (the ``exo`` command, a runner, a pipeline's stage), which never use PyTorch: mark it
    absent, so that transformers (mlx-lm loads tokenizers through it) does not import it wherever it is installed.
    On the NVIDIA machine that import was most of a process's ~20 s before it loaded anything; here, half of
    ``import exo.engine``. ``import torch`` then fails in that process. Not where torch is imported already, nor
    with EXO_IMPORT_TORCH=1; never on import of the package (a notebook's torch stays its own)."""
    if os.environ.get("EXO_IMPORT_TORCH", "").strip().lower() not in ("1", "true", "yes") and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec says absent, import raises ImportError
