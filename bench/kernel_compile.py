"""Compile exo's GatedDeltaNet CUDA kernels (engine/kernels/cuda_gdn.py: the step, the prompt kernel's two forms) for
a GPU architecture with NVRTC, without a GPU: whether they compile, and ptxas's registers, shared memory and spills
per instance. For writing kernels on a machine with no GPU (the dev install's NVRTC wheel on Linux x86-64, as
``tests/engine/test_cuda_build.py`` uses it; elsewhere point ``EXO_NVRTC_LIBRARY`` and ``CUDA_HOME`` at NVRTC and
CUDA's headers) before a GPU session spends its time on a build error or a block over the 48 KB of static shared
memory.

    python bench/kernel_compile.py [--arch 90] [--head-dims 64 128 256]

Exits 1 when an instance does not compile or uses more than 48 KB of shared memory or 64K registers a block.
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys

import mlx.core as mx

from exo.engine.kernels import cuda_gdn
from exo.engine.kernels.cuda_build import OPTIONS, include_dirs, kernel_source, nvrtc


def compile_log(source: str, options: list[str]) -> tuple[int, str]:
    lib = nvrtc().lib
    program = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"k.cu", 0, None, None)
    try:
        argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
        result = lib.nvrtcCompileProgram(program, len(options), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        text = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(program, text)
        return result, text.value.decode(errors="replace")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def instances(dk: int) -> list[tuple[str, object, list[tuple[str, object]], int]]:
    """(name, kernel, template, threads a block) of each kernel at head dim ``dk`` (the 9B's other dims)."""
    base = [("T", mx.bfloat16), ("TAPS", 4), ("HK", 16), ("HV", 32), ("DK", dk), ("DV", 128), ("PROMOTE_F32", False)]
    return [
        ("step, 4 rows", cuda_gdn._kernel(), [("ROWS", 4), *base], cuda_gdn.THREADS),
        ("prompt, form 1", cuda_gdn._prompt_kernel(), [("TILE_ROWS", cuda_gdn.tile_rows(dk, 1)), *base], cuda_gdn.THREADS),
        ("prompt, form 2", cuda_gdn._prompt2_kernel(),
         [("TILE_ROWS", cuda_gdn.tile_rows(dk, 2)), *base, ("PREP_THREADS", cuda_gdn.PREP_THREADS)],
         cuda_gdn.THREADS + cuda_gdn.PREP_THREADS),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90", help="compute capability without the dot (90: H100 / H200)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256])
    args = parser.parse_args()
    bf, f32 = mx.bfloat16, mx.float32
    suffix = "a" if int(args.arch) >= 90 else ""
    options = [*OPTIONS, f"--gpu-architecture=sm_{args.arch}{suffix}", *(f"--include-path={p}" for p in include_dirs()),
               "--ptxas-options=-v"]
    ok = True
    print(f"NVRTC {'.'.join(map(str, nvrtc().version))}, sm_{args.arch}{suffix}")
    for dk in args.head_dims:
        for name, kernel, template, threads in instances(dk):
            source = kernel_source("k", kernel.header, kernel.source, kernel.input_names,  # type: ignore[attr-defined]
                                   [bf, bf, bf, bf, bf, f32, bf, f32, f32], kernel.output_names,  # type: ignore[attr-defined]
                                   [bf, f32], template, [3, 3, 3, 3, 3, 1, 1, 4, 1])
            rc, log = compile_log(source, options)
            used = re.search(r"Used (\d+) registers.*?(\d+) bytes smem", log)
            spills = re.search(r"(\d+) bytes spill stores", log)
            if rc != 0 or used is None:
                ok = False
                errors = [line for line in log.splitlines() if "error" in line]
                print(f"head dim {dk:>3}  {name:<15} DOES NOT COMPILE: {' | '.join(errors)[:600]}")
                continue
            registers, smem = int(used.group(1)), int(used.group(2))
            fits = smem <= 48 * 1024 and registers * threads <= 65536
            ok &= fits
            print(f"head dim {dk:>3}  {name:<15} {registers:>4} registers x {threads} threads, {smem:>6} bytes shared, "
                  f"{spills.group(1) if spills else '?'} bytes spilled{'' if fits else '  OVER A BLOCK LIMIT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
