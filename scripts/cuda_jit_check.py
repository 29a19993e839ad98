"""Compile exo's `mx.fast.cuda_kernel` sources with NVRTC on a machine without a GPU, as MLX CUDA would.

MLX compiles a custom kernel at its first call, on the GPU machine, with NVRTC: a source that only nvcc accepts
fails there (the GPU's time is short). This runs a script with `mx.fast.cuda_kernel` replaced by a recorder that
builds each kernel's source as MLX's `build_kernel` does (`mlx/backend/cuda/custom_kernel.cpp`: the default
header, the kernel's header, the generated signature with `<input>_shape` / `_strides` / `_ndim` where the
source names them, template constants) and compiles it as MLX's `jit_module.cpp` does (its JIT headers by name,
`--device-as-default-execution-space`, `--gpu-architecture=compute_90a`, MLX's bundled include dirs and CUDA's);
every call returns zeros of the output shapes, so the script goes on through every kernel it would launch.

    python scripts/cuda_jit_check.py --jit DIR SCRIPT.py [ARGS...]

DIR holds what NVRTC needs (none of it ships with exo or on a CPU machine):
- `nvrtc/`: NVRTC's library (`pip download nvidia-cuda-nvrtc`, unzipped: `nvrtc/nvidia/cu13/lib/libnvrtc.so.13`);
- `mlxcuda/`: MLX CUDA's bundled headers (the `mlx/include` folder of the `mlx-cuda-13` wheel, which
  `shared/gpu/prepare.sh` downloads: `cat .gpu1/part_* .gpu2/part_* .gpu3/part_* > w.zip; unzip w.zip 'mlx/include/*'`);
- MLX's JIT device headers (`mlx/backend/cuda/device/*.cuh` and `config.h` of MLX's sources at the version that
  runs), flat in DIR.
SCRIPT sets things up so that exo's kernels think they run on MLX CUDA (e.g. `cuda_qgemv.on_cuda = lambda: True`)
and calls them on CPU arrays. Exits 1 at the first kernel that does not compile, printing NVRTC's log.

exo builds its kernels itself since 44c2a2a (`engine/kernels/cuda_build.py`, over a smaller prelude than MLX's), and
the suite compiles every one of them that way with NVRTC's wheel (`tests/engine/test_cuda_build.py`); this script
checks MLX's own build of them, the path exo falls back to (`EXO_CUDA_KERNEL_CACHE=0`, or a failed build).
"""

from __future__ import annotations

import argparse
import ctypes
import runpy
import sys
from pathlib import Path

import mlx.core as mx

HEADERS = ["atomic_ops", "binary_ops", "cast_op", "config", "complex", "cute_dequant", "fp16_math", "gemm_sm70",
           "hadamard", "indexing", "qmm_naive", "qmm_sm80", "qmm_sm90", "scatter_ops", "unary_ops", "ternary_ops",
           "utils"]
CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.uint32: "uint32_t",
              mx.uint8: "uint8_t", mx.int32: "int32_t", mx.int64: "int64_t", mx.uint16: "uint16_t", mx.bool_: "bool",
              mx.int8: "int8_t", mx.uint64: "uint64_t", mx.int16: "int16_t"}
DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'


class Compiler:
    def __init__(self, jit: Path, cuda_include: Path) -> None:
        self.lib = ctypes.CDLL(str(jit / "nvrtc" / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13"))
        self.includes = [jit / "mlxcuda" / "include", jit / "mlxcuda" / "include" / "cccl", cuda_include]
        self.headers = []
        for name in HEADERS:
            file = jit / (f"{name}.h" if name == "config" else f"{name}.cuh")
            self.headers.append((f"mlx/backend/cuda/device/{file.name}".encode(), file.read_bytes()))
        self.done: set[str] = set()

    def compile(self, name: str, source: str) -> None:
        if name in self.done:
            return
        prog = ctypes.c_void_p()
        names = (ctypes.c_char_p * len(self.headers))(*[n for n, _ in self.headers])
        texts = (ctypes.c_char_p * len(self.headers))(*[t for _, t in self.headers])
        rc = self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                         len(self.headers), texts, names)
        if rc:
            raise RuntimeError(f"nvrtcCreateProgram: {rc}")
        args = [b"--device-as-default-execution-space", b"--gpu-architecture=compute_90a",
                *[f"--include-path={p}".encode() for p in self.includes]]
        rc = self.lib.nvrtcCompileProgram(prog, len(args), (ctypes.c_char_p * len(args))(*args))
        size = ctypes.c_size_t()
        self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        self.lib.nvrtcGetProgramLog(prog, log)
        self.lib.nvrtcDestroyProgram(ctypes.byref(prog))
        text = log.value.decode(errors="replace").strip()
        if rc:
            print(f"FAILED {name}:\n{text}", file=sys.stderr)
            raise SystemExit(1)
        self.done.add(name)
        print(f"compiled {name}" + (f": {text}" if text else ""), file=sys.stderr)


def recorder(compiler: Compiler):
    class Kernel:
        def __init__(self, name: str, input_names, output_names, source: str, header: str = "",
                     ensure_row_contiguous: bool = True, shared_memory: int = 0) -> None:
            self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
            self.source, self.header = source, header

        def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, **_: object):
            template = list(template or [])
            suffix = ""
            for _, value in template:
                if isinstance(value, bool):
                    suffix += "_t" if value else "_f"
                elif isinstance(value, int):
                    suffix += f"_{value}"
                else:
                    suffix += f"_{CUDA_TYPES[value]}"
            name = f"{self.name}{suffix}"
            lines = [DEFAULT_HEADER, self.header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
                     f"__global__ void {name}(\n"]
            for input_name, value in zip(self.input_names, inputs, strict=True):
                value = value if isinstance(value, mx.array) else mx.array(value)
                lines.append(f"    const {CUDA_TYPES[value.dtype]}* {input_name},\n")
                if value.ndim > 0:
                    for part, kind in (("shape", "Shape"), ("strides", "Strides"), ("ndim", "int")):
                        if f"{input_name}_{part}" in self.source:
                            lines.append(f"    const __grid_constant__ {kind} {input_name}_{part},\n")
            outs = [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(self.output_names, output_dtypes, strict=True)]
            lines.append(",\n".join(outs) + ") {\n")
            for key, value in template:
                if isinstance(value, bool):
                    lines.append(f"  constexpr bool {key} = {'true' if value else 'false'};\n")
                elif isinstance(value, int):
                    lines.append(f"  constexpr int {key} = {value};\n")
                else:
                    lines.append(f"  using {key} = {CUDA_TYPES[value]};\n")
            lines.append("\n" + self.source + "\n}\n\n} // namespace mlx::core::cu\n")
            compiler.compile(name, "".join(lines))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes, strict=True)]

    return Kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jit", type=Path, required=True, help="the folder with nvrtc/, mlxcuda/ and MLX's JIT headers")
    parser.add_argument("--cuda-include", type=Path, default=Path("/usr/local/cuda/include"))
    parser.add_argument("script", type=Path)
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    mx.fast.cuda_kernel = recorder(Compiler(args.jit, args.cuda_include))
    sys.argv = [str(args.script), *args.args]
    runpy.run_path(str(args.script), run_name="__main__")


if __name__ == "__main__":
    main()
