"""exo's CUDA kernels compiled once per machine, not once per process.

MLX compiles a ``mx.fast.cuda_kernel`` with NVRTC the first time a process launches it and keeps the result in
that process only (its own kernels it caches on disk, ``MLX_PTX_CACHE_DIR``; custom kernels it does not). exo's
kernels (``cuda_qgemv``, ``cuda_gdn``, ``cuda_attn``) take their shapes as template constants, so a model reaches
many instances: on an H200 the 9B shape's load checks and warm-up compiled them for ~55 s of every process's start
(qgemv's check 22 s, the GatedDeltaNet kernel's 11 s, the products' warm-up 20 s; docs/performance.md), every
runner, every restart.

``CudaKernel`` is called as the function ``mx.fast.cuda_kernel`` returns. It writes the source MLX would write for
the call (the kernel's header, its signature from the inputs' and outputs' types, its template constants, its
body, in MLX's namespace) over a smaller prelude (CUDA's bfloat16 / half headers in place of MLX's device utilities,
which exo's kernels do not use: a compile ~7x faster), compiles it with NVRTC, the library MLX's CUDA wheel
brings, with MLX's options (``--device-as-default-execution-space``, the device's own architecture: the same
compiler, options and code, so the same machine code), stores the binary in ``kernel_dir()/cuda`` under a name that
hashes the source, the options, NVRTC's version and the architecture, and launches it with
``mx.fast.precompiled_cuda_kernel``. A later process reads the file.

Anything that fails to build (no NVRTC, no CUDA headers, a compile error) warns once and falls back to
``mx.fast.cuda_kernel``; ``EXO_CUDA_KERNEL_CACHE=0`` always uses it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

log = logging.getLogger(__name__)

CUDA_TYPES = {
    mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
    mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
    mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double",
}
# What MLX's custom kernels include (``default_header``: its device utilities, CCCL, cooperative groups) less what
# exo's kernels do not use: the bfloat16 and half types, and the fixed-width integers CCCL would have brought. Parsing
# MLX's headers was most of a compile (on a 2-core x86 CPU: 1.0 s an instance with them, 0.15 s without; the binary
# 101 KB against 25 KB, its symbols most of the difference).
PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
"""
# MLX's NVRTC options for its kernels (``jit_module.cpp``), less the architecture and include paths added per machine
OPTIONS = ("--device-as-default-execution-space",)

Template = Sequence[tuple[str, Any]]


class CudaBuildError(RuntimeError):
    """A kernel could not be compiled here (no NVRTC, no headers, the compiler's error)."""


def enabled() -> bool:
    return os.environ.get("EXO_CUDA_KERNEL_CACHE", "1").strip().lower() not in ("0", "false", "off", "no")


def cache_dir() -> Path:
    from . import kernel_dir

    return kernel_dir() / "cuda"


def _constant(name: str, value: Any) -> str:
    if isinstance(value, bool):  # (before int: a bool is an int)
        return f"  constexpr bool {name} = {'true' if value else 'false'};\n"
    if isinstance(value, int):
        return f"  constexpr int {name} = {value};\n"
    if isinstance(value, mx.Dtype):
        return f"  using {name} = {CUDA_TYPES[value]};\n"
    raise TypeError(f"template argument {name}: {value!r} (an int, a bool or an MLX dtype)")


def shaped_inputs(source: str, input_names: Sequence[str]) -> list[str]:
    """The inputs whose shape the body reads (``name_shape``, as MLX decides); their strides it may not read (MLX
    would pass them as int64: a precompiled kernel's scalars are 32-bit ints)."""
    for n in input_names:
        if f"{n}_strides" in source:
            raise CudaBuildError(f"{n}_strides: a precompiled kernel is not handed strides")
    return [n for n in input_names if f"{n}_shape" in source or f"{n}_ndim" in source]


def kernel_source(function: str, header: str, source: str, input_names: Sequence[str],
                  input_dtypes: Sequence[mx.Dtype], output_names: Sequence[str], output_dtypes: Sequence[mx.Dtype],
                  template: Template, input_ndims: Sequence[int] = ()) -> str:
    """The whole translation unit for one instance: what MLX's ``build_kernel`` writes for ``mx.fast.cuda_kernel``
    (inputs ``const T* name`` in order, then outputs ``T* name``, then the template constants, then the body, in
    ``mlx::core::cu``), the function ``extern "C"`` so that its name is ``function``. An input whose shape the body
    reads (``shaped_inputs``) gets it as ints after the outputs (``name_shape_0``, ...: the call's scalars, in
    order) and ``name_shape[i]`` / ``name_ndim`` in the body as MLX's ``Shape`` would give them (``input_ndims``:
    every input's ndim)."""
    params = [f"    const {CUDA_TYPES[d]}* {n}" for n, d in zip(input_names, input_dtypes, strict=True)]
    params += [f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes, strict=True)]
    ndims = dict(zip(input_names, input_ndims, strict=False))
    shapes = ""
    for n in shaped_inputs(source, input_names):
        params += [f"    const int {n}_shape_{i}" for i in range(ndims[n])]
        values = ", ".join(f"{n}_shape_{i}" for i in range(ndims[n]))
        shapes += f"  const int {n}_shape[{max(ndims[n], 1)}] = {{{values}}};\n  constexpr int {n}_ndim = {ndims[n]};\n"
    constants = "".join(_constant(n, v) for n, v in template) + shapes
    return (f"{PRELUDE}\n{header}\nnamespace mlx::core::cu {{\n\n"
            f'extern "C" __global__ void {function}(\n' + ",\n".join(params) + ") {\n"
            + constants + ("\n" if constants else "") + source + "\n}\n\n} // namespace mlx::core::cu\n")


# -- NVRTC --------------------------------------------------------------------------------------------------------

def _library_candidates() -> list[str]:
    names = [os.environ["EXO_NVRTC_LIBRARY"]] if os.environ.get("EXO_NVRTC_LIBRARY") else []
    # already loaded by MLX's CUDA backend (the soname finds it), else the wheels' own copies, else the system's
    names += ["libnvrtc.so.13", "libnvrtc.so.12"]
    for root in _roots():
        for sub in ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib"):
            names += sorted(str(p) for p in (Path(root) / sub).glob("libnvrtc.so*") if "builtins" not in p.name)
    found = ctypes.util.find_library("nvrtc")
    return names + ([found] if found else [])


def _roots() -> list[str]:
    return [p for p in dict.fromkeys(sys.path) if p and os.path.isdir(p)]


def include_dirs() -> list[str]:
    """Where CUDA's headers are (cuda_bf16.h): the wheels' (``nvidia/cu13``, ``nvidia/cuda_runtime``), else CUDA_HOME,
    CUDA_PATH, /usr/local/cuda."""
    found = [Path(root) / sub for root in _roots() for sub in ("nvidia/cu13/include", "nvidia/cuda_runtime/include")]
    found += [Path(home) / "include" for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                                                  "/usr/local/cuda") if home]
    return [str(p) for p in dict.fromkeys(found) if (p / "cuda_bf16.h").is_file()]


class _Nvrtc:
    def __init__(self) -> None:
        errors = []
        for name in _library_candidates():
            try:
                self.lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errors.append(f"{name}: {e}")
        else:
            raise CudaBuildError("no NVRTC library found (" + "; ".join(errors[-3:]) + ")")
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
            raise CudaBuildError(f"{what}: {self.lib.nvrtcGetErrorString(result).decode()}")

    def compile(self, source: str, name: str, options: Sequence[str], sass: bool) -> bytes:
        program = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{name}.cu".encode(), 0,
                                                None, None), "nvrtcCreateProgram")
        try:
            argv = (ctypes.c_char_p * len(options))(*(o.encode() for o in options))
            result = self.lib.nvrtcCompileProgram(program, len(options), argv)
            if result != 0:
                size = ctypes.c_size_t()
                self.lib.nvrtcGetProgramLogSize(program, ctypes.byref(size))
                text = ctypes.create_string_buffer(size.value + 1)
                self.lib.nvrtcGetProgramLog(program, text)
                raise CudaBuildError(f"{name} did not compile: {text.value.decode(errors='replace').strip()}")
            get_size, get = ((self.lib.nvrtcGetCUBINSize, self.lib.nvrtcGetCUBIN) if sass
                             else (self.lib.nvrtcGetPTXSize, self.lib.nvrtcGetPTX))
            size = ctypes.c_size_t()
            self._check(get_size(program, ctypes.byref(size)), "the binary's size")
            binary = ctypes.create_string_buffer(size.value)
            self._check(get(program, binary), "the binary")
            return binary.raw
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(program))


_lock = threading.Lock()
_nvrtc: list[_Nvrtc] = []


def nvrtc() -> _Nvrtc:
    with _lock:
        if not _nvrtc:
            _nvrtc.append(_Nvrtc())
        return _nvrtc[0]


@dataclass(frozen=True)
class Built:
    function: str  # the kernel's name in the binary
    binary: bytes  # a cubin (or PTX where NVRTC cannot write the device's machine code)
    compiled: bool  # compiled in this call (False: read from the cache)


def device_architecture() -> tuple[int, int]:
    """The GPU's compute capability (major, minor), as MLX reports it."""
    try:
        info = mx.device_info(mx.gpu)
        return int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    except (KeyError, ValueError, RuntimeError, TypeError) as e:
        raise CudaBuildError(f"the GPU's compute capability is unknown ({type(e).__name__}: {e})") from e


def build(name: str, source_of: Any, architecture: tuple[int, int], directory: Path | None = None) -> Built:
    """The binary of one instance: ``source_of(function)`` its source given its function's name, compiled for
    ``architecture`` (compute capability) into ``directory`` (default ``cache_dir()``), or read from there."""
    compiler = nvrtc()
    major, minor = architecture
    sass = compiler.version >= (12, 0)  # (MLX: NVRTC 11.8 and later write every device's machine code)
    includes = include_dirs()
    if not includes:
        raise CudaBuildError("no CUDA headers (cuda_bf16.h) found: set CUDA_HOME")
    arch = f"--gpu-architecture={'sm' if sass else 'compute'}_{major}{minor}{'a' if major >= 9 else ''}"
    options = [*OPTIONS, arch, *(f"--include-path={p}" for p in includes)]
    text = source_of(name)
    # the name hashes what makes the binary (the source, options but for where the headers are, NVRTC, the device)
    made_of = [text, *OPTIONS, arch, "{}.{}".format(*compiler.version)]
    digest = hashlib.sha256("\0".join(made_of).encode()).hexdigest()[:20]
    function = f"{name}_{digest}"
    directory = cache_dir() if directory is None else directory
    path = directory / f"{function}.{'cubin' if sass else 'ptx'}"
    try:
        kept = path.read_bytes()
        if kept.startswith(b"\x7fELF" if sass else b"//"):  # (anything else: a damaged file, compiled anew)
            return Built(function, kept, False)
    except OSError:
        pass
    binary = compiler.compile(source_of(function), function, options, sass)
    try:  # atomically: a process reading it meanwhile sees all of it or none
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=f".{function}.", delete=False) as f:
            f.write(binary)
        os.replace(f.name, path)
    except OSError as e:
        log.warning("exo: cannot keep the compiled kernel %s in %s (%s)", function, directory, e)
    return Built(function, binary, True)


def precompiled_failed(error: BaseException) -> bool:
    """For a kernel's load check whose launches raised when evaluated (a precompiled launch fails only there, lazily):
    if they were this module's, the process turns every ``CudaKernel`` to MLX's compile, says why, and the check
    should run again (True); False where they were MLX's already (the check then fails as before)."""
    if CudaKernel.fallback_reason is not None or not enabled():
        return False
    CudaKernel.fallback_reason = f"a precompiled launch failed: {type(error).__name__}: {str(error)[:300]}"
    log.warning("exo: CUDA kernels compiled by MLX in every process (%s)", CudaKernel.fallback_reason)
    return True


class CudaKernel:
    """``mx.fast.cuda_kernel(name=..., input_names=..., output_names=..., source=..., header=...,
    ensure_row_contiguous=...)``, compiled once per machine (see the module). Called as MLX's is."""

    fallback_reason: str | None = None  # why this process uses mx.fast.cuda_kernel (the first failure)

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True) -> None:
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header, self.ensure_row_contiguous = source, header, ensure_row_contiguous
        self._built: dict[tuple[Any, ...], Built] = {}
        self._launches: dict[tuple[Any, ...], Built] = {}
        self._shaped: list[int] | None = None  # the inputs whose shapes the body reads (None: not called yet)
        self._mine = True  # False: this kernel takes MLX's path (EXO_CUDA_KERNEL_CACHE=0, or strides read)
        self._mlx: Any = None
        self.compiled = 0  # instances this process compiled (the others it read)

    def _fallback(self) -> Any:
        if self._mlx is None:
            self._mlx = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names,
                                            output_names=self.output_names, source=self.source, header=self.header,
                                            ensure_row_contiguous=self.ensure_row_contiguous)
        return self._mlx

    def instance(self, input_dtypes: Sequence[mx.Dtype], output_dtypes: Sequence[mx.Dtype], template: Template,
                 input_ndims: Sequence[int] = (), architecture: tuple[int, int] | None = None,
                 directory: Path | None = None) -> Built:
        """The compiled instance for these types, template constants and (where the body reads their shapes) the
        inputs' ndims, built or read once per process."""
        key = (tuple(input_dtypes), tuple(output_dtypes), tuple(template), tuple(input_ndims), architecture,
               directory)
        built = self._built.get(key)
        if built is None:
            tag = hashlib.sha256(repr(key[:4]).encode()).hexdigest()[:8]  # (only to tell instances apart in a name)

            def source_of(function: str) -> str:
                return kernel_source(function, self.header, self.source, self.input_names, input_dtypes,
                                     self.output_names, output_dtypes, template, input_ndims)

            built = build(f"exo_{self.name}_{tag}", source_of, architecture or device_architecture(), directory)
            self.compiled += built.compiled
            self._built[key] = built
        return built

    def _shapes_read(self) -> list[int]:
        """The inputs whose shapes the body reads (decided at the first call, with whether to compile here at all)."""
        if self._shaped is None:
            self._shaped = []
            try:
                names = shaped_inputs(self.source, self.input_names)
                self._shaped = [i for i, n in enumerate(self.input_names) if n in names]
            except CudaBuildError as e:
                self._mine = False
                log.warning("exo: %s compiled by MLX in every process (%s)", self.name, e)
            self._mine = self._mine and enabled()
        return self._shaped

    def _built_for(self, template: Template, input_dtypes: Sequence[mx.Dtype], output_dtypes: Sequence[mx.Dtype],
                   input_ndims: Sequence[int]) -> Built | None:
        """The compiled instance of a call of these types, constants and ndims, or None where this process uses
        MLX's path (a build failure turns every kernel to it)."""
        shaped = self._shapes_read()
        if not self._mine or CudaKernel.fallback_reason is not None:
            return None
        key = (tuple(template), *input_dtypes, *output_dtypes, *(input_ndims[i] for i in shaped))
        found = self._launches.get(key)
        if found is None:
            try:
                found = self.instance(input_dtypes, output_dtypes, template, input_ndims)
            except (CudaBuildError, OSError, KeyError) as e:
                CudaKernel.fallback_reason = str(e)
                log.warning("exo: CUDA kernels compiled by MLX in every process (%s)", e)
                return None
            self._launches[key] = found
        return found

    def launch(self, inputs: Sequence[mx.array], template: Template,
               output_dtypes: Sequence[mx.Dtype]) -> tuple[Built, list[int]] | None:
        """The call's compiled instance and its scalars (the shapes the body reads), or None where this process
        uses MLX's path. The host's cost per launch: one key of the call's types and constants, one dict lookup;
        the instance is built once per key. (``bind``: a call site's launch with all of that done once.)"""
        found = self._built_for(template, [x.dtype for x in inputs], output_dtypes, [x.ndim for x in inputs])
        if found is None:
            return None
        return found, [d for i in self._shapes_read() for d in inputs[i].shape]

    def bind(self, template: Template, input_dtypes: Sequence[mx.Dtype], input_ndims: Sequence[int],
             output_dtypes: Sequence[mx.Dtype], grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
             init_value: float | None = None) -> BoundLaunch:
        """This kernel's launch with everything but the inputs and the output shapes fixed: what a call site that
        makes the same launch again and again (a decode step's ~170) keeps, so that each launch is one call into
        MLX (its arguments the ones ``__call__`` would pass)."""
        return BoundLaunch(self, list(template), list(output_dtypes), grid, threadgroup, init_value,
                           self._built_for(template, input_dtypes, output_dtypes, input_ndims))

    def __call__(self, *, inputs: Sequence[mx.array], template: Template = (), grid: tuple[int, int, int],
                 threadgroup: tuple[int, int, int], output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[mx.Dtype], init_value: float | None = None,
                 stream: Any = None) -> list[mx.array]:
        launch = self.launch(inputs, template, output_dtypes)
        if launch is not None:
            built, scalars = launch
            return mx.fast.precompiled_cuda_kernel(
                name=built.function, compiled_source=built.binary, inputs=inputs,
                output_shapes=output_shapes,  # type: ignore[arg-type]  # (sequences of ints, as MLX's binding takes)
                output_dtypes=output_dtypes, scalars=scalars, grid=grid, threadgroup=threadgroup,
                init_value=init_value, ensure_row_contiguous=self.ensure_row_contiguous, stream=stream)
        return self._fallback()(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                                output_shapes=output_shapes, output_dtypes=output_dtypes, init_value=init_value,
                                stream=stream)


class BoundLaunch:
    """``CudaKernel.bind``: ``bound(inputs, output_shapes)`` is ``kernel(inputs=inputs, output_shapes=output_shapes,
    **the bound arguments)``, with the compiled instance and the launch's constants found once. The inputs must have
    the types and ndims it was bound for. Where the process turned to MLX's compile (a failed build or launch, at
    any time), it takes ``CudaKernel.__call__``'s path."""

    __slots__ = ("kernel", "template", "output_dtypes", "grid", "threadgroup", "init_value", "built", "shaped",
                 "contiguous")

    def __init__(self, kernel: CudaKernel, template: list[tuple[str, Any]], output_dtypes: list[mx.Dtype],
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int], init_value: float | None,
                 built: Built | None) -> None:
        self.kernel, self.template, self.output_dtypes = kernel, template, output_dtypes
        self.grid, self.threadgroup, self.init_value, self.built = grid, threadgroup, init_value, built
        self.shaped = kernel._shapes_read()
        self.contiguous = kernel.ensure_row_contiguous

    def __call__(self, inputs: Sequence[mx.array], output_shapes: Sequence[Sequence[int]],
                 stream: Any = None) -> list[mx.array]:
        built = self.built
        if built is None or CudaKernel.fallback_reason is not None:
            return self.kernel(inputs=inputs, template=self.template, grid=self.grid, threadgroup=self.threadgroup,
                               output_shapes=output_shapes, output_dtypes=self.output_dtypes,
                               init_value=self.init_value, stream=stream)
        return mx.fast.precompiled_cuda_kernel(
            name=built.function, compiled_source=built.binary, inputs=inputs,
            output_shapes=output_shapes,  # type: ignore[arg-type]
            output_dtypes=self.output_dtypes, scalars=[d for i in self.shaped for d in inputs[i].shape],
            grid=self.grid, threadgroup=self.threadgroup, init_value=self.init_value,
            ensure_row_contiguous=self.contiguous, stream=stream)
