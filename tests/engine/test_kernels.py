"""exo's CPU kernels (``exo.engine.kernels``): bit-identical to MLX's bfloat16 matmul and to mlx-lm's gated
delta rule, used by the engine's linear and GatedDeltaNet layers on the CPU backend where they build, and
MLX's own ops wherever they cannot."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.activations import swiglu
from mlx_lm.models.qwen3_next import Qwen3NextMLP

from exo.engine import GenerationRequest, kernels, load
from exo.engine.kernels import bits_equal, gated_delta_inputs
from exo.engine.models import layers
from exo.engine.models.layers import Attention, CpuEmbedding, CpuLinear, CpuMLP, GatedDeltaNet

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


@pytest.fixture(scope="module", params=["linear", "packed"])
def product(request, linear):
    """x @ w.T by the kernel as called with w, or with w packed (``pack_linear``, what the layers use)."""
    if request.param == "linear":
        return linear
    packed = kernels.cpu_linear_packed()
    return lambda x, w: packed(x, kernels.pack_linear(w), w.shape[0])


@pytest.fixture(scope="module")
def gated_delta(linear):
    return kernels.cpu_gated_delta()


def _bits(a: mx.array) -> list[int]:
    return a.view(mx.uint16).reshape(-1).tolist()


@needs_kernel
@pytest.mark.parametrize(
    "m,n,k",
    # every path: whole 8-column blocks and the N % 8 tail, K's 8-blocks and its tail, row blocks of 4 and
    # their remainder, one row (decode), a verify's few rows, a batch's many; packed: N % 16 tails, odd K,
    # tiles of 8, 4, 2 and 1 rows and their mixes (15 = 8 + 4 + 2 + 1), more blocks than a tile's
    [(1, 8, 8), (1, 768, 256), (2, 13, 37), (3, 5, 3), (4, 64, 1024), (5, 4096, 256), (7, 9, 17),
     (8, 768, 256), (17, 100, 300), (32, 256, 1024), (1, 1, 1), (15, 200, 33), (22, 4, 256), (9, 17, 2)],
)
def test_products_are_bit_identical_to_mlx(product, m, n, k):
    key = mx.random.key(m * 10_000 + n * 100 + k)
    kx, kw = mx.random.split(key)
    x = (mx.random.normal((m, k), key=kx) * 4).astype(mx.bfloat16)
    w = (mx.random.normal((n, k), key=kw) * 0.05).astype(mx.bfloat16)
    with mx.stream(mx.cpu):
        assert _bits(product(x, w)) == _bits(x @ w.T)


@needs_kernel
def test_special_values_round_as_mlx_rounds_them(product):
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
        assert _bits(product(x, w)) == _bits(x @ w.T)


@needs_kernel
def test_any_layout_of_the_input(product):
    """Leading batch dimensions, a transposed (non-contiguous) input and a sliced one: as ``x @ w.T``."""
    w = mx.random.normal((48, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    batched = mx.random.normal((2, 3, 64), key=mx.random.key(2)).astype(mx.bfloat16)
    transposed = mx.random.normal((64, 10), key=mx.random.key(3)).astype(mx.bfloat16).T
    sliced = mx.random.normal((4, 5, 64), key=mx.random.key(4)).astype(mx.bfloat16)[:, -1:, :]
    with mx.stream(mx.cpu):
        for x in (batched, transposed, sliced):
            got = product(x, w)
            assert got.shape == (*x.shape[:-1], 48)
            assert _bits(got) == _bits(x @ w.T)


@needs_kernel
def test_empty_products_are_mlx_s(product):
    for x, w in ((mx.zeros((0, 8)), mx.ones((5, 8))), (mx.ones((3, 0)), mx.ones((5, 0))),
                 (mx.ones((3, 8)), mx.ones((0, 8)))):
        x, w = x.astype(mx.bfloat16), w.astype(mx.bfloat16)
        with mx.stream(mx.cpu):
            got, want = product(x, w), x @ w.T
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
def test_silu_and_swiglu_are_mlx_s_on_every_bfloat16_input(linear):
    """Every one of the 65536 bfloat16 values (NaNs, infinities, zeros of both signs, subnormals) as ``a``, times
    several ``b`` (of every magnitude, and the special values), in odd shapes (the tail of 8)."""
    silu = kernels.cpu_silu()
    a = kernels.every_bfloat16()
    with mx.stream(mx.cpu):
        assert _bits(silu(a)) == _bits(nn.silu(a))
        for i, scale in enumerate((1e-3, 1.0, 30.0, 1e30)):
            b = (mx.random.normal(a.shape, key=mx.random.key(i)) * scale).astype(mx.bfloat16)
            assert _bits(silu(a, b)) == _bits(swiglu(a, b))
        assert _bits(silu(a, a[::-1])) == _bits(swiglu(a, a[::-1]))  # b non-contiguous, and special values
        odd = a[:1000].reshape(8, 125)[:, :13]  # [8, 13], strided
        assert _bits(silu(odd, odd)) == _bits(swiglu(odd, odd)) and _bits(silu(odd)) == _bits(nn.silu(odd))
        empty = mx.zeros((0, 4), dtype=mx.bfloat16)
        assert silu(empty).shape == (0, 4)


@needs_kernel
def test_silu_bad_arguments_are_typed_errors(linear):
    silu = kernels.cpu_silu()
    with pytest.raises(ValueError, match="bfloat16"):
        silu(mx.ones((2, 4)))
    with pytest.raises(ValueError, match="one shape"):
        silu(mx.ones((2, 4), dtype=mx.bfloat16), mx.ones((2, 5), dtype=mx.bfloat16))
    with pytest.raises(TypeError, match="1 or 2 arguments"):
        silu()


def test_pack_linear_lays_two_k_steps_of_16_outputs_in_a_word():
    n, k = 18, 5
    values = mx.arange(1, n * k + 1).reshape(n, k).astype(mx.bfloat16)
    packed = kernels.pack_linear(values)
    assert packed.shape == (2, 3, 16) and packed.dtype == mx.uint32
    bits = values.view(mx.uint16).tolist()
    words = packed.tolist()
    for b in range(2):
        for j in range(3):
            for i in range(16):
                row = 16 * b + i
                lo = bits[row][2 * j] if row < n else 0
                hi = bits[row][2 * j + 1] if row < n and 2 * j + 1 < k else 0
                assert words[b][j][i] == lo | hi << 16
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.pack_linear(mx.ones((4, 4)))


@needs_kernel
def test_packed_bad_arguments_are_typed_errors(linear):
    packed = kernels.cpu_linear_packed()
    x = mx.ones((2, 6), dtype=mx.bfloat16)
    wp = kernels.pack_linear(mx.ones((20, 6), dtype=mx.bfloat16))
    with pytest.raises(ValueError, match="not w \\[N, K\\] packed"):
        packed(x, wp, 40)  # N
    with pytest.raises(ValueError, match="not w \\[N, K\\] packed"):
        packed(mx.ones((2, 8), dtype=mx.bfloat16), wp, 20)  # K
    with pytest.raises(ValueError, match="uint32"):
        packed(x, mx.ones((2, 3, 16)), 20)
    with pytest.raises(TypeError, match="3 arguments"):
        packed(x, wp)


@needs_kernel
def test_a_layer_packs_its_weight_once_and_again_when_it_is_replaced(linear):
    layer = nn.Linear(40, 24, bias=False)
    layer.weight = layer.weight.astype(mx.bfloat16)
    x = mx.random.normal((3, 40), key=mx.random.key(5)).astype(mx.bfloat16)
    from exo.engine.models.layers import use_cpu_kernels

    assert use_cpu_kernels(layer) and type(layer) is CpuLinear
    packed = layer.__dict__["_exo_packed"]
    assert "_exo_packed" not in layer.parameters()  # outside the module's tree (weights, saving, loading)
    with mx.stream(mx.cpu):
        assert _bits(layer(x)) == _bits(x @ layer.weight.T)
        assert layer.__dict__["_exo_packed"] is packed  # not packed again
        layer.weight = (layer.weight * 3).astype(mx.bfloat16)  # load_weights does this
        assert _bits(layer(x)) == _bits(x @ layer.weight.T)
    assert layer.__dict__["_exo_packed"] is not packed


@needs_kernel
def test_the_isa_follows_the_cpu_and_exo_cpu_kernels_isa(monkeypatch):
    monkeypatch.delenv("EXO_CPU_KERNELS_ISA", raising=False)
    flags = kernels._cpu_flags()
    assert kernels.isa() == ("avx512" if " avx512f " in flags else "avx2")
    monkeypatch.setenv("EXO_CPU_KERNELS_ISA", "avx2")
    assert kernels.isa() == "avx2"
    monkeypatch.setenv("EXO_CPU_KERNELS_ISA", "sse9")
    module, reason = kernels._load()
    assert module is None and "EXO_CPU_KERNELS_ISA='sse9'" in reason


@needs_kernel
def test_the_avx2_build_gives_mlx_s_bits_too(monkeypatch, tmp_path, linear):
    """A machine without AVX-512 builds the AVX2 code (two registers per 16 outputs): built here on demand,
    checked at load, and its packed products equal MLX's on every tile."""
    monkeypatch.setenv("EXO_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("EXO_CPU_KERNELS_ISA", "avx2")
    built, reason = kernels._load()
    assert reason == "built" and built is not None
    (module,) = tmp_path.glob("*/_exo_cpu_kernels*")
    assert "-mavx512f" not in kernels._flags("avx2")
    key = mx.random.key(9)
    for m, n, k in ((1, 70, 33), (4, 16, 64), (2, 40, 12), (9, 100, 300), (5, 4, 256)):
        kx, kw, key = mx.random.split(key, 3)
        x = (mx.random.normal((m, k), key=kx) * 4).astype(mx.bfloat16)
        w = (mx.random.normal((n, k), key=kw) * 0.05).astype(mx.bfloat16)
        with mx.stream(mx.cpu):
            assert _bits(built.linear_packed(x, kernels.pack_linear(w), n)) == _bits(x @ w.T)
            assert _bits(built.linear(x, w)) == _bits(x @ w.T)
    a = kernels.every_bfloat16()
    with mx.stream(mx.cpu):
        assert _bits(built.silu(a, a[::-1])) == _bits(swiglu(a, a[::-1]))


@needs_kernel
def test_the_engine_runs_its_layers_on_the_kernels_with_plain_mlx_outputs(linear):
    """exo-demo (bfloat16) on the CPU: every bias-free linear layer and the tied lm_head take the linear
    kernel, every GatedDeltaNet the recurrence kernel, and the logits over a prompt and the greedy tokens
    equal those of the same model on MLX's matmul and mlx-lm's gated delta ops."""
    engine = load("exo-demo")
    model = engine.loaded.model
    classes = [type(m) for _, m in model.named_modules()]
    assert classes.count(CpuLinear) >= 8 * 4 and CpuEmbedding in classes
    assert nn.Linear not in classes and nn.Embedding not in classes
    deltas = [m for _, m in model.named_modules() if isinstance(m, GatedDeltaNet)]
    assert deltas and all(m.cpu_gated_delta is not None for m in deltas)
    assert any(issubclass(c, CpuMLP) for c in classes) and all(m.cpu_silu is not None for m in deltas)  # (fused or not)
    kernel_layers = [m for _, m in model.named_modules() if type(m) in (CpuLinear, CpuEmbedding)]
    assert all("_exo_packed" in m.__dict__ for m in kernel_layers)  # packed at load, not in a step
    head_modules = list(engine.loaded.head.named_modules()) if engine.loaded.head is not None else []
    attention = [m for _, m in [*model.named_modules(), *head_modules] if isinstance(m, Attention)]
    assert len(attention) == 3 and all(m.cpu_linear is not None for m in attention)  # the backbone's 2, the head's
    # long enough for the attention kernel (its scores per key head past CPU_ATTENTION_MIN_SCORES)
    ids = engine.loaded.tokenizer.encode("def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n" * 6)
    assert 2 * len(ids) ** 2 >= layers.CPU_ATTENTION_MIN_SCORES
    request = GenerationRequest(ids, max_tokens=24, native_mtp="off")
    with_kernel = engine.complete(request).token_ids
    logits = model(mx.array([ids]))
    mx.eval(logits)

    for _, module in model.named_modules():  # back to mlx's own classes: MLX's matmul
        if type(module) is CpuLinear:
            module.__class__ = nn.Linear
        elif type(module) is CpuEmbedding:
            module.__class__ = nn.Embedding
        elif type(module) is CpuMLP:  # mlx-lm's compiled swiglu
            module.__class__ = Qwen3NextMLP
    for _, module in engine.loaded.head.named_modules() if engine.loaded.head is not None else ():
        if type(module) is CpuLinear:
            module.__class__ = nn.Linear
    for module in deltas:  # and mlx-lm's gated delta ops, MLX's silu
        del module.cpu_gated_delta, module.cpu_silu
    for module in attention:  # and MLX's attention
        module.cpu_linear = None
    plain_logits = model(mx.array([ids]))
    assert _bits(logits) == _bits(plain_logits)
    assert engine.complete(request).token_ids == with_kernel


@needs_kernel
@pytest.mark.parametrize(
    "b,h,hk,t,length,d,mask",
    # exo-demo's prefill chunk at an offset (2 query heads a key head) and its decode step; more rows than a
    # query block, from position 0; Qwen3.5-9B's heads (16 and 4 of 256) and 27B's ratio (6:1); a batch's
    # boolean masks (left padding) shared by the heads or per head, its decode step; one head each
    [(1, 2, 1, 40, 3000, 64, "causal"), (1, 2, 1, 1, 3000, 64, None), (1, 2, 1, 600, 600, 64, "causal"),
     (1, 16, 4, 9, 700, 256, "causal"), (1, 24, 4, 3, 200, 128, "causal"), (3, 4, 2, 7, 400, 64, "shared"),
     (3, 4, 2, 1, 1100, 64, "per-head"), (2, 1, 1, 30, 90, 64, "causal")],
)
def test_attention_is_bit_identical_to_mlx(b, h, hk, t, length, d, mask):
    """``cpu_attention`` (the two products on the linear kernel) against ``mx.fast.scaled_dot_product_attention``
    on MLX's CPU backend, bit for bit; and each layer's dispatch takes it on these shapes."""
    assert layers.cpu_attention_matches()
    key = mx.random.key(t * length + d)
    kq, kk, kv, km = mx.random.split(key, 4)
    q = mx.random.normal((b, h, t, d), key=kq).astype(mx.bfloat16)
    k = mx.random.normal((b, hk, length, d), key=kk).astype(mx.bfloat16)
    v = mx.random.normal((b, hk, length, d), key=kv).astype(mx.bfloat16)
    m = {"shared": lambda: mx.random.uniform(shape=(b, 1, t, length), key=km) > 0.2,
         "per-head": lambda: mx.random.uniform(shape=(b, h, t, length), key=km) > 0.2}.get(mask, lambda: mask)()
    assert layers._cpu_attention_fits(q, k, v, None, m)
    scale = d**-0.5
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m)
    got = layers.cpu_attention(kernels.cpu_linear(), q, k, v, scale, m)
    assert got.shape == want.shape and _bits(got) == _bits(want)


@needs_kernel
@pytest.mark.parametrize(
    "b,t,hk,hv,dk,dv,dtype,masked",
    # exo-demo's decode step, a batch's, a prompt; Qwen3.5-9B's heads; no GQA; float32 inputs; Dk and Dv not
    # multiples of 8 (the kernel's scalar tails); masked rows (a batch's left padding)
    [(1, 1, 2, 4, 64, 64, mx.bfloat16, False), (8, 1, 2, 4, 64, 64, mx.bfloat16, False),
     (1, 22, 2, 4, 64, 64, mx.bfloat16, False), (2, 3, 16, 32, 128, 128, mx.bfloat16, False),
     (2, 5, 4, 4, 32, 16, mx.bfloat16, False), (2, 5, 2, 4, 64, 64, mx.float32, False),
     (1, 9, 1, 3, 40, 24, mx.float32, True), (3, 17, 2, 4, 64, 64, mx.bfloat16, True), (1, 4, 1, 1, 5, 3, mx.bfloat16, True)],
)
def test_gated_delta_is_bit_identical_to_mlx_lm(gated_delta, b, t, hk, hv, dk, dv, dtype, masked):
    """y and the new state, every bit, as mlx-lm's ``gated_delta_ops`` (its compiled step, row by row)."""
    from mlx_lm.models.gated_delta import gated_delta_ops

    key = mx.random.key(b * 1000 + t * 10 + dk)
    args = gated_delta_inputs(key, b, t, hk, hv, dk, dv, dtype)
    mask = mx.random.uniform(shape=(b, t), key=mx.random.split(key)[0]) > 0.3 if masked else None
    with mx.stream(mx.cpu):
        want, got = gated_delta_ops(*args, mask), gated_delta(*args, mask)
        assert got[0].shape == (b, t, hv, dv) and got[0].dtype == dtype and got[1].dtype == mx.float32
        assert bits_equal(got[0], want[0]) and bits_equal(got[1], want[1])
        if masked:  # a fully masked call keeps the state
            none = mx.zeros((b, t), dtype=mx.bool_)
            assert bits_equal(gated_delta(*args, none)[1], args[-1])


@needs_kernel
def test_gated_delta_bad_arguments_are_typed_errors(gated_delta):
    q, k, v, g, beta, state = gated_delta_inputs(mx.random.key(0), 1, 2, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="multiple of Hk"):
        gated_delta(q, k, v[:, :, :3], g[..., :3], beta[..., :3], state[:, :3], None)
    with pytest.raises(ValueError, match="g \\[B, T, Hv\\] float32"):
        gated_delta(q, k, v, g.astype(mx.bfloat16), beta, state, None)
    with pytest.raises(ValueError, match="state"):
        gated_delta(q, k, v, g, beta, state.astype(mx.bfloat16), None)
    with pytest.raises(ValueError, match="mask"):
        gated_delta(q, k, v, g, beta, state, mx.ones((1, 3), dtype=mx.bool_))
    with pytest.raises(TypeError, match="7 arguments"):
        gated_delta(q, k, v)


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
    assert reason == "built" and built is not None and built.gated_delta is not None
    (module,) = tmp_path.glob("*/_exo_cpu_kernels*")
    stamp = module.stat().st_mtime_ns
    again, reason = kernels._load()
    assert reason == "built" and module.stat().st_mtime_ns == stamp
    x = mx.ones((2, 16), dtype=mx.bfloat16)
    with mx.stream(mx.cpu):
        assert _bits(again.linear(x, x)) == _bits(x @ x.T)


def test_kernel_dir_default_is_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("EXO_KERNEL_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernels.kernel_dir() == Path(tmp_path) / "exo" / "kernels"
