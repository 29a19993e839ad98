"""MLX CUDA's code paths on a machine without a GPU, for the host's cost of building graphs (``build_profile.py
--emulate-cuda``): exo's kernels installed as the loader installs them on MLX CUDA (their load-time checks taken as
passed), compiled for sm_90 by NVRTC (the dev install's wheel on Linux x86-64), and every launch
stubbed (``mx.fast.precompiled_cuda_kernel`` returns zeros of the outputs' shapes, unevaluated). The Python that
builds a step then is the GPU's, op for op; what MLX's own launch costs on the GPU (converting the arguments,
copying the binary into the primitive, the launch at evaluation) is not here. Never part of exo itself."""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def emulate_cuda() -> None:
    """Install the emulation (before the model is loaded: the loader decides the kernels)."""
    from exo.engine.kernels import cuda_attn, cuda_build, cuda_gdn, cuda_qgemv

    cuda_qgemv.on_cuda = lambda: True
    cuda_qgemv.on_cuda_device = lambda: True
    cuda_gdn.on_cuda = lambda: True
    cuda_attn.on_cuda = lambda: True
    for module in (cuda_qgemv, cuda_gdn, cuda_attn):
        module.check = lambda *a, **k: (True, "emulated")  # type: ignore[attr-defined]
    cuda_gdn.check_prompt = lambda *a, **k: (True, "emulated")
    cuda_build.device_architecture = lambda: (9, 0)

    def launch(*, name: str, compiled_source: bytes, inputs: Any, output_shapes: Any, output_dtypes: Any,
               scalars: Any, grid: Any, threadgroup: Any, init_value: Any = None, ensure_row_contiguous: bool = True,
               stream: Any = None) -> list[mx.array]:
        return [mx.zeros(tuple(s), dtype=d) for s, d in zip(output_shapes, output_dtypes, strict=True)]

    mx.fast.precompiled_cuda_kernel = launch
