"""exo's CUDA kernels compiled once per machine (``kernels.cuda_build``): with no GPU, by the NVRTC library MLX's
CUDA wheel uses (a dev dependency on Linux x86-64), every kernel's source compiles for an H200 (sm_90a), each
instance is kept on disk, and a later process reads it instead of compiling again."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from exo.engine.kernels import cuda_attn, cuda_gdn, cuda_qgemv
from exo.engine.kernels.cuda_build import CudaBuildError, CudaKernel, kernel_source, shaped_inputs

H200 = (9, 0)
needs_nvrtc = pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() == "x86_64"),
                                 reason="NVRTC's wheel (a dev dependency) is for Linux x86-64")


def qgemv_kernel() -> CudaKernel:
    return cuda_qgemv._kernel()


def test_the_source_is_mlxs_layout_with_shapes_as_ints_after_the_outputs():
    text = kernel_source("f_1", "// header", "out[0] = x[0] + w_shape[1];", ["x", "w"], [mx.bfloat16, mx.uint32],
                         ["out"], [mx.float32], [("T", mx.float16), ("ROWS", 3), ("FLAG", True)], [2, 2])
    signature = text[text.index('extern "C" __global__ void f_1('):text.index(") {")]
    assert signature.split("(", 1)[1].split(",\n") == [
        "\n    const __nv_bfloat16* x", "    const uint32_t* w", "    float* out", "    const int w_shape_0",
        "    const int w_shape_1"]
    assert "  using T = __half;\n  constexpr int ROWS = 3;\n  constexpr bool FLAG = true;\n" in text
    assert "  const int w_shape[2] = {w_shape_0, w_shape_1};\n  constexpr int w_ndim = 2;\n" in text
    assert text.index("// header") < text.index("namespace mlx::core::cu {") < text.index("out[0] = x[0]")
    assert shaped_inputs("x_shape[0] + w[1]", ["x", "w"]) == ["x"]
    with pytest.raises(CudaBuildError, match="strides"):
        shaped_inputs("x_strides[0]", ["x"])
    with pytest.raises(TypeError, match="ROWS"):
        kernel_source("f", "", "", ["x"], [mx.float32], ["o"], [mx.float32], [("ROWS", 1.5)])


@needs_nvrtc
def test_every_kernel_compiles_for_an_h200_once_and_is_read_from_disk_after(tmp_path: Path):
    bf16, f16 = mx.bfloat16, mx.float16
    built = []
    q = qgemv_kernel()
    assert isinstance(q, CudaKernel)
    for bits in cuda_qgemv.BITS:  # every layout the engine hands the kernel
        for group in cuda_qgemv.GROUPS:
            for dtype in (bf16, f16):
                template, _ = cuda_qgemv._launch(1, 4096, 4096, bits, group, dtype, dtype)
                built.append(q.instance([dtype, mx.uint32, dtype, dtype], [dtype], template, [2, 2, 2, 2], H200,
                                        tmp_path))
    for rows in range(2, cuda_qgemv.MAX_ROWS + 1):  # a verify call's and a batch step's row counts
        template, _ = cuda_qgemv._launch(rows, 12288, 4096, 4, 64, bf16, bf16)
        built.append(q.instance([bf16, mx.uint32, bf16, bf16], [bf16], template, [2, 2, 2, 2], H200, tmp_path))
    gdn = cuda_gdn._kernel()
    for rows, promote in ((1, True), (4, False)):
        built.append(gdn.instance([bf16] * 5 + [mx.float32, bf16, mx.float32, mx.float32], [bf16, mx.float32],
                                  [("T", bf16), ("ROWS", rows), ("TAPS", 4), ("HK", 16), ("HV", 32), ("DK", 128),
                                   ("DV", 128), ("PROMOTE_F32", promote)], [3, 3, 2, 3, 3, 1, 1, 4, 1], H200,
                                  tmp_path))
    for variant in (1, 2):  # the prompt kernel's forms (a chunk's rows in one launch), for 9B's GatedDeltaNet
        kernel = cuda_gdn._prompt2_kernel() if variant == 2 else cuda_gdn._prompt_kernel()
        template = [("T", bf16), ("TILE_ROWS", cuda_gdn.tile_rows(128, variant)), ("TAPS", 4), ("HK", 16),
                    ("HV", 32), ("DK", 128), ("DV", 128), ("PROMOTE_F32", False)]
        template += [("PREP_THREADS", cuda_gdn.PREP_THREADS)] if variant == 2 else []
        built.append(kernel.instance([bf16] * 5 + [mx.float32, bf16, mx.float32, mx.float32], [bf16, mx.float32],
                                     template, [3, 3, 3, 3, 3, 1, 1, 4, 1], H200, tmp_path))
    first, second = cuda_attn._kernels()
    built.append(first.instance([bf16] * 3 + [mx.int32, mx.float32], [mx.float32] * 3,
                                [("T", bf16), ("D", 256), ("HQ", 16), ("HKV", 4), ("CHUNK", cuda_attn.CHUNK),
                                 ("WARPS_", cuda_attn.WARPS)], [4, 4, 4, 1, 1], H200, tmp_path))
    built.append(second.instance([mx.float32] * 3 + [mx.int32], [bf16], [("T", bf16), ("D", 256),
                                                                          ("CHUNK", cuda_attn.CHUNK)],
                                 [2, 2, 3, 1], H200, tmp_path))
    assert all(b.compiled for b in built)
    assert all(b.binary[:4] == b"\x7fELF" and b.function.encode() in b.binary for b in built)  # a cubin, its kernel
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(f"{b.function}.cubin" for b in built)  # one file an instance, no temporaries left
    # another process: nothing compiled, the same binaries
    script = (
        "import sys, mlx.core as mx; from pathlib import Path; from exo.engine.kernels import cuda_qgemv;"
        "t, _ = cuda_qgemv._launch(3, 12288, 4096, 4, 64, mx.bfloat16, mx.bfloat16);"
        "b = cuda_qgemv._kernel().instance([mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16], [mx.bfloat16], t,"
        " [2, 2, 2, 2], (9, 0), Path(sys.argv[1])); print(b.compiled, b.function)")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    compiled, function = out.stdout.split()
    assert compiled == "False" and function == built[len(cuda_qgemv.BITS) * len(cuda_qgemv.GROUPS) * 2 + 1].function
    assert sorted(p.name for p in tmp_path.iterdir()) == files


@needs_nvrtc
def test_the_binary_names_what_made_it(tmp_path: Path):
    """Another architecture, another template constant or another body: another file (a stale binary is never
    read for a changed kernel); the same: the same file."""
    q = qgemv_kernel()
    template, _ = cuda_qgemv._launch(1, 4096, 4096, 4, 64, mx.bfloat16, mx.bfloat16)
    types = ([mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16], [mx.bfloat16])
    a = q.instance(*types, template, [2, 2, 2, 2], H200, tmp_path)
    b = q.instance(*types, template, [2, 2, 2, 2], (8, 0), tmp_path)
    changed = CudaKernel(q.name, q.input_names, q.output_names, q.source + "\n// changed", q.header)
    c = changed.instance(*types, template, [2, 2, 2, 2], H200, tmp_path)
    again = CudaKernel(q.name, q.input_names, q.output_names, q.source, q.header).instance(
        *types, template, [2, 2, 2, 2], H200, tmp_path)
    assert len({a.function, b.function, c.function}) == 3
    assert again.function == a.function and not again.compiled and again.binary == a.binary
    # a damaged file (not a cubin) is compiled anew and replaced
    (tmp_path / f"{a.function}.cubin").write_bytes(b"\0" * 64)
    mended = CudaKernel(q.name, q.input_names, q.output_names, q.source, q.header).instance(
        *types, template, [2, 2, 2, 2], H200, tmp_path)
    assert mended.compiled and mended.binary == a.binary == (tmp_path / f"{a.function}.cubin").read_bytes()


@needs_nvrtc
def test_a_kernel_that_does_not_compile_says_why(tmp_path: Path):
    broken = CudaKernel("broken", ["x"], ["out"], "out[0] = undefined_name;")
    with pytest.raises(CudaBuildError, match="undefined_name"):
        broken.instance([mx.float32], [mx.float32], [], [1], H200, tmp_path)
    assert list(tmp_path.iterdir()) == []


@needs_nvrtc
def test_a_launch_finds_its_instance_once_and_hands_the_shapes_the_body_reads(tmp_path: Path, monkeypatch):
    """What ``CudaKernel.__call__`` hands ``mx.fast.precompiled_cuda_kernel`` (which needs a GPU): the instance for the
    call's types and constants, built on its first launch only, and as scalars the shapes of the inputs whose shape
    the body reads (qgemv reads w's); off with EXO_CUDA_KERNEL_CACHE=0, or for a body that reads strides."""
    from exo.engine.kernels import cuda_build

    monkeypatch.setattr(cuda_build, "device_architecture", lambda: H200)  # (the GPU's answer; the compile is real)
    monkeypatch.setenv("EXO_KERNEL_DIR", str(tmp_path))
    q = CudaKernel("exo_qgemv", ["x", "w", "scales", "biases"], ["out"], cuda_qgemv.SOURCE, cuda_qgemv.HEADER)
    template, _ = cuda_qgemv._launch(2, 256, 512, 4, 64, mx.bfloat16, mx.bfloat16)
    x = mx.zeros((2, 512), dtype=mx.bfloat16)
    w, scales, biases = mx.quantize(mx.zeros((256, 512), dtype=mx.bfloat16), group_size=64, bits=4)
    first = q.launch([x, w, scales, biases], template, [mx.bfloat16])
    assert first is not None and first[1] == [256, 64]  # w's shape, after the outputs
    again = q.launch([x, w, scales, biases], list(template), [mx.bfloat16])
    assert again is not None and again[0] is first[0] and q.compiled == 1
    assert [p.name for p in (tmp_path / "cuda").iterdir()] == [f"{first[0].function}.cubin"]
    monkeypatch.setenv("EXO_CUDA_KERNEL_CACHE", "0")
    off = CudaKernel("exo_qgemv", ["x", "w", "scales", "biases"], ["out"], cuda_qgemv.SOURCE, cuda_qgemv.HEADER)
    assert off.launch([x, w, scales, biases], template, [mx.bfloat16]) is None
    monkeypatch.delenv("EXO_CUDA_KERNEL_CACHE")
    strides = CudaKernel("reads_strides", ["x"], ["out"], "out[0] = x[x_strides[0]];")
    assert strides.launch([x], [], [mx.bfloat16]) is None and CudaKernel.fallback_reason is None


def test_a_precompiled_launch_that_fails_turns_the_process_to_mlxs_compile_once(monkeypatch):
    """A precompiled launch fails lazily, where a load check evaluates it: the check asks ``precompiled_failed``,
    which turns every kernel to MLX's compile and has the check run again, once; with the cache off, never."""
    from exo.engine.kernels import cuda_build

    monkeypatch.setattr(CudaKernel, "fallback_reason", None)
    assert cuda_build.precompiled_failed(RuntimeError("Failed to load compiled kernel"))
    assert "Failed to load compiled kernel" in CudaKernel.fallback_reason
    q = CudaKernel("exo_qgemv", ["x", "w", "scales", "biases"], ["out"], cuda_qgemv.SOURCE, cuda_qgemv.HEADER)
    assert q.launch([mx.zeros((1, 512), dtype=mx.bfloat16)], [], [mx.bfloat16]) is None  # MLX's path from now on
    assert not cuda_build.precompiled_failed(RuntimeError("again"))  # the check's second failure is its own
    monkeypatch.setattr(CudaKernel, "fallback_reason", None)
    monkeypatch.setenv("EXO_CUDA_KERNEL_CACHE", "0")
    assert not cuda_build.precompiled_failed(RuntimeError("MLX's own compile failed"))


def test_a_bound_launch_hands_mlx_what_a_call_would_and_follows_the_process_to_mlxs_compile(tmp_path: Path, monkeypatch):
    """``CudaKernel.bind`` (a call site's launch with its constants fixed once: qgemv's ~130 a decode step) hands
    ``mx.fast.precompiled_cuda_kernel`` exactly the arguments ``CudaKernel.__call__`` does, its scalars the shapes of
    each call's inputs; once the process turns to MLX's compile, it takes that path too; and qgemv's decode-sized
    products go through it."""
    from exo.engine.kernels import cuda_build

    monkeypatch.setattr(cuda_build, "device_architecture", lambda: H200)  # (the GPU's answer; the compile is real)
    monkeypatch.setenv("EXO_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(CudaKernel, "fallback_reason", None)
    calls: list[dict] = []

    def precompiled(**kwargs):
        calls.append(kwargs)
        return [mx.zeros(tuple(s), dtype=d) for s, d in zip(kwargs["output_shapes"], kwargs["output_dtypes"], strict=True)]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    q = CudaKernel("exo_qgemv", ["x", "w", "scales", "biases"], ["out"], cuda_qgemv.SOURCE, cuda_qgemv.HEADER)
    template, grid = cuda_qgemv._launch(2, 256, 512, 4, 64, mx.bfloat16, mx.bfloat16)
    w, scales, biases = mx.quantize(mx.zeros((256, 512), dtype=mx.bfloat16), group_size=64, bits=4)
    bound = q.bind(template, [mx.bfloat16, mx.uint32, mx.bfloat16, mx.bfloat16], [3, 2, 2, 2], [mx.bfloat16], grid,
                   cuda_qgemv.THREADGROUP)
    for x in (mx.zeros((1, 2, 512), dtype=mx.bfloat16), mx.ones((2, 1, 512), dtype=mx.bfloat16)):
        q(inputs=[x, w, scales, biases], template=template, grid=grid, threadgroup=cuda_qgemv.THREADGROUP,
          output_shapes=[(*x.shape[:-1], 256)], output_dtypes=[mx.bfloat16])
        bound([x, w, scales, biases], [(*x.shape[:-1], 256)])
        by_call, by_bound = calls[-2:]
        assert by_call.keys() == by_bound.keys() and by_call["inputs"][0] is x and by_bound["inputs"][0] is x
        for name in by_call:
            if name != "inputs":
                assert list(by_call[name]) == list(by_bound[name]) if isinstance(by_call[name], (list, tuple)) \
                    else by_call[name] == by_bound[name], name
        assert by_bound["scalars"] == [256, 64] and by_bound["compiled_source"].startswith(b"\x7fELF")
    assert q.compiled == 1  # one instance, built once for both
    # the process turned to MLX's compile: the bound launch goes where a call goes
    fallback: list[dict] = []
    monkeypatch.setattr(CudaKernel, "fallback_reason", "a precompiled launch failed")
    monkeypatch.setattr(q, "_fallback", lambda: lambda **kwargs: fallback.append(kwargs) or [mx.zeros((1, 2, 256))])
    before = len(calls)
    bound([x, w, scales, biases], [(*x.shape[:-1], 256)])
    assert len(calls) == before and fallback and fallback[0]["template"] == list(template)
    # qgemv's decode-sized products launch through bound launches, one per layer shape and row count
    monkeypatch.setattr(CudaKernel, "fallback_reason", None)
    monkeypatch.setattr(cuda_qgemv, "on_cuda", lambda: True)
    cuda_qgemv._bound.cache_clear()
    x = mx.zeros((1, 1, 512), dtype=mx.bfloat16)
    calls.clear()
    for _ in range(3):
        cuda_qgemv.qgemv(x, w, scales, biases, group_size=64, bits=4)
    assert len(calls) == 3 and cuda_qgemv._bound.cache_info().misses == 1
    assert calls[0]["output_shapes"] == [(1, 1, 256)] and calls[0]["scalars"] == [256, 64]
    cuda_qgemv._bound.cache_clear()


def test_a_gatednet_step_launches_through_its_bound_launch_as_a_call_would(tmp_path: Path, monkeypatch):
    """``cuda_gdn.gdn_rows`` (every GatedDeltaNet layer of every decode step) launches through a bound launch per
    inputs' types and shapes, handing MLX what the kernel's ``__call__`` with the step's template would."""
    from types import SimpleNamespace

    from exo.engine.kernels import cuda_build

    monkeypatch.setattr(cuda_build, "device_architecture", lambda: H200)
    monkeypatch.setenv("EXO_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(CudaKernel, "fallback_reason", None)
    monkeypatch.setattr(cuda_gdn, "on_cuda", lambda: True)
    calls: list[dict] = []

    def precompiled(**kwargs):
        calls.append(kwargs)
        return [mx.zeros(tuple(s), dtype=d) for s, d in zip(kwargs["output_shapes"], kwargs["output_dtypes"], strict=True)]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", precompiled)
    hk, hv, dk, dv, taps = 2, 4, 64, 64, 4
    conv_dim = 2 * hk * dk + hv * dv
    layer = SimpleNamespace(num_k_heads=hk, num_v_heads=hv, head_k_dim=dk, head_v_dim=dv, conv_kernel_size=taps,
                            conv1d=SimpleNamespace(weight=mx.zeros((conv_dim, taps, 1), dtype=mx.bfloat16)),
                            A_log=mx.zeros((hv,), dtype=mx.float32), dt_bias=mx.zeros((hv,), dtype=mx.bfloat16))
    window = mx.zeros((1, taps - 1, conv_dim), dtype=mx.bfloat16)
    qkv = mx.zeros((1, 2, conv_dim), dtype=mx.bfloat16)
    a = b = mx.zeros((1, 2, hv), dtype=mx.bfloat16)
    state = mx.zeros((1, hv, dv, dk), dtype=mx.float32)
    cuda_gdn._rows_launch.cache_clear()
    for _ in range(2):
        cuda_gdn.gdn_rows(layer, window, qkv, a, b, state)
    assert cuda_gdn._rows_launch.cache_info().misses == 1
    cuda_gdn._kernel()(
        inputs=[window, qkv, layer.conv1d.weight, a, b, layer.A_log, layer.dt_bias, state,
                cuda_gdn._scalars(layer, qkv.dtype)],
        template=[("T", mx.bfloat16), ("ROWS", 2), ("TAPS", taps), ("HK", hk), ("HV", hv), ("DK", dk), ("DV", dv),
                  ("PROMOTE_F32", False)],  # (a and dt_bias both bfloat16)
        grid=(cuda_gdn.THREADS * hv * (dv // cuda_gdn.TILE), 1, 1), threadgroup=(cuda_gdn.THREADS, 1, 1),
        output_shapes=[(1, 2, hv, dv), (2, 1, hv, dv, dk)], output_dtypes=[mx.bfloat16, mx.float32])
    bound, called = calls[-2], calls[-1]
    for name in called:
        if name != "inputs":
            assert list(bound[name]) == list(called[name]) if isinstance(called[name], (list, tuple)) \
                else bound[name] == called[name], name
    assert bound["scalars"] == [1, hv, dv, dk]  # the state's shape (the body reads its batch)
    cuda_gdn._rows_launch.cache_clear()
