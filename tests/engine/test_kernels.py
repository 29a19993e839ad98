"""exo's CPU kernel (``exo.engine.kernels``): bit-identical to MLX's bfloat16 matmul, used by the engine's
linear layers on the CPU backend where it builds, and MLX's own product wherever it cannot."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from exo.engine import GenerationRequest, kernels, load
from exo.engine.models.layers import CpuEmbedding, CpuLinear

on_x86_linux = sys.platform == "linux" and platform.machine() == "x86_64"
needs_kernel = pytest.mark.skipif(not on_x86_linux, reason="exo's CPU kernel is for x86-64 Linux")


@pytest.fixture(scope="module")
def linear():
    fn = kernels.cpu_linear()
    if fn is None and on_x86_linux and "AVX2" not in kernels.status():
        pytest.fail(f"the CPU kernel did not build on this x86-64 machine: {kernels.status()}")
    if fn is None:
        pytest.skip(kernels.status())
    return fn


def _bits(a: mx.array) -> list[int]:
    return a.view(mx.uint16).reshape(-1).tolist()


@needs_kernel
@pytest.mark.parametrize(
    "m,n,k",
    # every path: whole 8-column blocks and the N % 8 tail, K's 8-blocks and its tail, row blocks of 4 and
    # their remainder, one row (decode), a verify's few rows, a batch's many
    [(1, 8, 8), (1, 768, 256), (2, 13, 37), (3, 5, 3), (4, 64, 1024), (5, 4096, 256), (7, 9, 17),
     (8, 768, 256), (17, 100, 300), (32, 256, 1024), (1, 1, 1)],
)
def test_products_are_bit_identical_to_mlx(linear, m, n, k):
    key = mx.random.key(m * 10_000 + n * 100 + k)
    kx, kw = mx.random.split(key)
    x = (mx.random.normal((m, k), key=kx) * 4).astype(mx.bfloat16)
    w = (mx.random.normal((n, k), key=kw) * 0.05).astype(mx.bfloat16)
    with mx.stream(mx.cpu):
        assert _bits(linear(x, w)) == _bits(x @ w.T)


@needs_kernel
def test_special_values_round_as_mlx_rounds_them(linear):
    """Overflow to inf, NaN (MLX's 0x7FC0), signed zeros, values that round to even at bfloat16's last bit."""
    x = mx.array([[1e38, 1e38, 0.0, -0.0, 1.0, 3.0, 1.0, 1.0, 2.0],
                  [float("nan"), 1.0, -0.0, -0.0, 1.0, 1.0, 1.0, 1.0, 1.0],
                  [-0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0],
                  [1.0, 2 ** -8, 2 ** -9, 2 ** -9, 2 ** -10, 1.0, -1.0, 2 ** -8, 0.5]], dtype=mx.bfloat16)
    w = mx.array([[1e38, 1e38, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [1.0] * 9, [-0.0] * 9,
                  [1.0, 1.0, 1.0, 1.0, 1.0, -1.0, 1.0, 1.0, 1.0], [0.0] * 9, [3.0, -3.0, 2.0, 1.0, 0.5, 0.25, 8.0, 1.0, 1.0],
                  [float("inf")] + [1.0] * 8, [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
                  [2 ** -9] * 9], dtype=mx.bfloat16)
    with mx.stream(mx.cpu):
        assert _bits(linear(x, w)) == _bits(x @ w.T)


@needs_kernel
def test_any_layout_of_the_input(linear):
    """Leading batch dimensions, a transposed (non-contiguous) input and a sliced one: as ``x @ w.T``."""
    w = mx.random.normal((48, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    batched = mx.random.normal((2, 3, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    transposed = mx.random.normal((64, 10), key=mx.random.key(3)).astype(mx.bfloat16).T
    sliced = mx.random.normal((4, 5, 64), key=mx.random.key(4)).astype(mx.bfloat16)[:, -1:, :]
    with mx.stream(mx.cpu):
        for x in (batched, transposed, sliced):
            got = linear(x, w)
            assert got.shape == (*x.shape[:-1], 48)
            assert _bits(got) == _bits(x @ w.T)


@needs_kernel
def test_empty_products_are_mlx_s(linear):
    for x, w in ((mx.zeros((0, 8)), mx.ones((5, 8))), (mx.ones((3, 0)), mx.ones((5, 0))),
                 (mx.ones((3, 8)), mx.ones((0, 8)))):
        x, w = x.astype(mx.bfloat16), w.astype(mx.bfloat16)
        with mx.stream(mx.cpu):
            got, want = linear(x, w), x @ w.T
            assert got.shape == want.shape and _bits(got) == _bits(want)


@needs_kernel
def test_bad_arguments_are_typed_errors(linear):
    with pytest.raises(ValueError, match="bfloat16"):
        linear(mx.ones((2, 4)), mx.ones((3, 4)))
    with pytest.raises(ValueError, match="x \\[..., K\\] and w \\[N, K\\]"):
        linear(mx.ones((2, 4), dtype=mx.bfloat16), mx.ones((3, 5), dtype=mx.bfloat16))
    with pytest.raises(TypeError, match="mlx.core.array"):
        linear(1, 2)


@needs_kernel
def test_the_engine_runs_its_linear_layers_on_the_kernel_with_plain_mlx_outputs(linear):
    """exo-demo (bfloat16) on the CPU: every bias-free linear layer and the tied lm_head take the kernel,
    and the logits and the greedy tokens equal those of the same model on MLX's own matmul."""
    engine = load("exo-demo")
    model = engine.loaded.model
    classes = [type(m) for _, m in model.named_modules()]
    assert classes.count(CpuLinear) >= 8 * 4 and CpuEmbedding in classes
    assert nn.Linear not in classes and nn.Embedding not in classes
    ids = engine.loaded.tokenizer.encode("def fibonacci(n):")
    request = GenerationRequest(ids, max_tokens=24, native_mtp="off")
    with_kernel = engine.complete(request).token_ids
    logits = model(mx.array([ids]))
    mx.eval(logits)

    for _, module in model.named_modules():  # back to mlx's own classes: MLX's matmul
        if type(module) is CpuLinear:
            module.__class__ = nn.Linear
        elif type(module) is CpuEmbedding:
            module.__class__ = nn.Embedding
    for _, module in engine.loaded.head.named_modules() if engine.loaded.head is not None else ():
        if type(module) is CpuLinear:
            module.__class__ = nn.Linear
    plain_logits = model(mx.array([ids]))
    assert _bits(logits) == _bits(plain_logits)
    assert engine.complete(request).token_ids == with_kernel


def test_off_switch(monkeypatch):
    monkeypatch.setenv("EXO_CPU_KERNELS", "0")
    linear, reason = kernels._load()
    assert linear is None and reason.startswith("off")


@needs_kernel
def test_no_compiler_leaves_mlx_matmul_in_place(monkeypatch, tmp_path):
    monkeypatch.setenv("EXO_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    linear, reason = kernels._load()
    assert linear is None and "no C++ compiler" in reason
    assert not list(tmp_path.iterdir())


@needs_kernel
def test_a_failed_build_is_reported_once_and_not_retried(monkeypatch, tmp_path):
    monkeypatch.setenv("EXO_KERNEL_DIR", str(tmp_path))
    compiler = tmp_path / "failing-c++"
    compiler.write_text("#!/bin/sh\necho 'fatal error: Python.h: No such file or directory' >&2\nexit 1\n")
    compiler.chmod(0o755)
    calls = tmp_path / "calls"
    monkeypatch.setenv("CXX", str(compiler))
    linear, reason = kernels._load()
    assert linear is None and reason.startswith("the build failed: fatal error: Python.h") and "delete it" in reason
    (failed,) = tmp_path.glob("*/build-failed.txt")
    assert "Python.h" in failed.read_text()
    compiler.write_text(f"#!/bin/sh\ntouch {calls}\nexit 1\n")
    linear, reason = kernels._load()
    assert linear is None and reason.startswith("an earlier build failed: fatal error: Python.h")
    assert not calls.exists()


@needs_kernel
def test_the_build_lands_where_exo_kernel_dir_says_and_is_reused(monkeypatch, tmp_path, linear):
    """A fresh directory builds (the real compiler), a second load reuses the module without building."""
    monkeypatch.setenv("EXO_KERNEL_DIR", str(tmp_path))
    built, reason = kernels._load()
    assert reason == "built" and built is not None
    (module,) = tmp_path.glob("*/_exo_cpu_kernels*")
    stamp = module.stat().st_mtime_ns
    again, reason = kernels._load()
    assert reason == "built" and module.stat().st_mtime_ns == stamp
    x = mx.ones((2, 16), dtype=mx.bfloat16)
    with mx.stream(mx.cpu):
        assert _bits(again(x, x)) == _bits(x @ x.T)


def test_kernel_dir_default_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("EXO_KERNEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.kernel_dir() == Path(tmp_path) / "exo" / "kernels"
