"""exo's quantized matrix-vector kernel (engine/kernels/cuda_qgemv.py): its arithmetic, and the engine's wiring.

The kernel itself runs on MLX CUDA only (bench/qmv_check.py checks it there against ``emulate`` bit for bit);
here ``emulate``, the same arithmetic in MLX operations, is what ``qgemv`` runs: these tests check that the
arithmetic computes the layer's product (MLX's affine layout, every bit width, group and dtype it takes) closer to
the exact value than MLX's own product, that no row's value depends on the others, and that with
``EXO_QGEMV=always`` the loader puts a quantized model's linear layers on it, plain decoding then runs it, and
greedy MTP still gives plain decoding's tokens.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, load_checkpoint
from exo.engine.kernels import cuda_qgemv
from exo.engine.models.layers import QGemvEmbedding, QGemvLinear, use_qgemv
from exo.engine.verify import verify_logits
from tests.engine.quantized import quantized_linear

# (N, K): K split over 1, 2 and 4 warps (``split_for`` at 4 bits), a K of one group
SHAPES = ((4096, 256), (2048, 4096), (32, 4096), (40, 64))


def _layer(n: int, k: int, bits: int, group: int, dtype, key: mx.array) -> nn.QuantizedLinear:
    return quantized_linear(n, k, bits, group, dtype, key)


def test_the_shapes_reach_every_split():
    assert {cuda_qgemv.split_for(n, k, 4) for n, k in SHAPES} == {1, 2, 4}


@pytest.mark.parametrize("n,k", SHAPES)
def test_a_launch_covers_every_output_for_every_row_count(n, k):
    """The kept launch arguments (``_launch``): the grid's warps reach every output of the layer at each row count,
    the template carries the layer's K (the kernel reads x as ROWS rows of K, whatever its leading dims)."""
    for rows in range(1, cuda_qgemv.MAX_ROWS + 1):
        template, grid = cuda_qgemv._launch(rows, n, k, 4, 64, mx.bfloat16, mx.bfloat16)
        constants = dict(template)
        assert constants["K"] == k and constants["ROWS"] == rows
        split = constants["SPLIT"]
        assert split == cuda_qgemv.split_for(n, k, 4)
        blocks = grid[0] // cuda_qgemv.THREADGROUP[0]
        covered = blocks * (cuda_qgemv.WARPS // split) * constants["OUTS"]
        assert covered >= n > covered - (cuda_qgemv.WARPS // split) * constants["OUTS"]
        assert cuda_qgemv._launch(rows, n, k, 4, 64, mx.bfloat16, mx.bfloat16) is cuda_qgemv._launch(
            rows, n, k, 4, 64, mx.bfloat16, mx.bfloat16)  # kept, not rebuilt per call


@pytest.mark.parametrize("bits", cuda_qgemv.BITS)
@pytest.mark.parametrize("group", cuda_qgemv.GROUPS)
@pytest.mark.parametrize("dtype", cuda_qgemv.DTYPES, ids=["bfloat16", "float16"])
def test_the_arithmetic_computes_the_product_closer_than_mlx(bits, group, dtype):
    """Against a float32 reference, relative to sum |x||w| of each output: within ``REFERENCE_TOLERANCE`` (about a
    rounding of the output), and nearer than MLX's own product (which rounds dequantized weights and partial sums
    to 16 bits). A wrong nibble order, group or bias is off by O(1)."""
    for n, k in SHAPES[:2] + SHAPES[3:]:
        if k % group:
            continue
        key = mx.random.key(bits * 1000 + group + n)
        layer = _layer(n, k, bits, group, dtype, key)
        x = (mx.random.normal((3, k), key=mx.random.split(key)[0]) * 0.5).astype(dtype)
        got = cuda_qgemv.module_product(layer, x)
        assert got.dtype == dtype and got.shape == (3, n)
        dense = mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32),
                              group_size=group, bits=bits)
        exact = x.astype(mx.float32) @ dense.T
        magnitude = mx.abs(x.astype(mx.float32)) @ mx.abs(dense).T
        own = (mx.abs(got.astype(mx.float32) - exact) / magnitude).max().item()
        mlx = (mx.abs(layer(x).astype(mx.float32) - exact) / magnitude).max().item()
        assert own <= cuda_qgemv.REFERENCE_TOLERANCE, (n, k, own)
        assert own < mlx, (n, k, own, mlx)


@pytest.mark.parametrize("bits", cuda_qgemv.BITS)
def test_every_row_is_computed_alone(bits):
    """A call of 1 to 9 rows (more than a launch's ``MAX_ROWS``) gives each row the bits it gets alone, for a
    QuantizedLinear and a QuantizedEmbedding's ``as_linear``, with every split of K."""
    key = mx.random.key(bits)
    for n, k in SHAPES:
        layer = _layer(n, k, bits, 64 if k >= 64 else 32, mx.bfloat16, key)
        x = (mx.random.normal((1, 9, k), key=mx.random.split(key)[1]) * 0.5).astype(mx.bfloat16)
        single = [cuda_qgemv.module_product(layer, x[:, t : t + 1]) for t in range(9)]
        for rows in (2, 4, 9):
            block = cuda_qgemv.module_product(layer, x[:, :rows])
            assert mx.array_equal(block.view(mx.uint16), mx.concatenate(single[:rows], axis=1).view(mx.uint16)).item()
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(96, 256), group_size=64, bits=bits)
    x = (mx.random.normal((5, 256), key=key) * 0.5).astype(mx.float32).astype(embedding.scales.dtype)
    block = cuda_qgemv.module_product(embedding, x)
    assert mx.array_equal(block, mx.concatenate([cuda_qgemv.module_product(embedding, x[t : t + 1]) for t in range(5)]))


def test_the_check_passes_on_a_layer():
    """``check``'s measures on this device (here ``emulate``: launches of rows against rows alone, the reference,
    the tolerances) pass, and say what they found."""
    for bits in cuda_qgemv.BITS:
        passed, found = cuda_qgemv.check(_layer(256, 512, bits, 64, mx.bfloat16, mx.random.key(5)))
        assert passed and found.startswith("error "), found


@pytest.fixture
def qgemv_everywhere(monkeypatch):
    monkeypatch.setenv("EXO_QGEMV", "always")


@pytest.mark.parametrize(("arch", "layout"), [("qwen3_5", "mlx_q4_sidecar"), ("qwen3_5", "mlx_q8_sidecar"),
                                              ("qwen3_5_moe", "mlx_q4_sidecar")])
def test_the_loader_puts_quantized_layers_on_the_kernel_and_mtp_stays_exact(checkpoint, qgemv_everywhere, arch,
                                                                            layout):
    """``EXO_QGEMV=always``: every quantized linear layer of the backbone and the head (the MoE routers and shared
    experts among them, at 8 bits; the tied embedding's ``as_linear``) runs the kernel's arithmetic, so plain
    decoding's logits are no longer MLX's product's; greedy MTP at every depth and adaptive still gives plain
    decoding's tokens (its verify rows go through the same arithmetic as the decode steps)."""
    loaded = load_checkpoint(checkpoint(arch, layout=layout, head="trained", dtype="bfloat16"))
    assert loaded.qgemv and all(v.startswith("ok") for v in loaded.qgemv.values()), loaded.qgemv
    model, head = loaded.model, loaded.head
    assert head is not None
    quantized = [m for tree in (model, head) for _, m in tree.named_modules()
                 if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))]
    assert quantized and all(type(m) in (QGemvLinear, QGemvEmbedding) for m in quantized)
    if loaded.model.is_moe:  # the 8-bit routers and shared-expert gates too
        assert {m.bits for m in quantized} == {4, 8}
    tokens = mx.array([[5, 9, 2, 7, 1, 3]])
    hidden = model.hidden(tokens, model.make_cache())[:, -1:]
    kernel = model.logits(hidden)
    for m in quantized:
        m.__class__ = nn.QuantizedLinear if type(m) is QGemvLinear else nn.QuantizedEmbedding
    try:
        stock = model.logits(hidden)
    finally:
        for m in quantized:
            m.__class__ = QGemvLinear if type(m) is nn.QuantizedLinear else QGemvEmbedding
    assert not mx.array_equal(kernel, stock).item()  # the kernel's product, not MLX's
    assert mx.allclose(kernel.astype(mx.float32), stock.astype(mx.float32), atol=0.1, rtol=0.05).item()

    # A verify call's logits equal the plain steps' at each row, bit for bit (what keeps MTP exact on any model:
    # a trained fixture's margins hide small differences from the token comparison below)
    engine = Engine(loaded, EngineConfig(prefill_chunk=8))
    forward, rows = engine.forward, [11, 4, 8, 6]
    forward.verify = engine.verify_mode
    # every quantized shape's block of rows is its rows alone: nothing runs row by row
    assert engine.verify_mode.exact and engine.verify_mode.per_row_linears == 0, engine.verify_probe
    assert all(v for name, v in engine.verify_probe.items() if name.startswith("linear ")), engine.verify_probe
    steps, verify = forward.new_cache(), forward.new_cache()
    for cache in (steps, verify):
        forward.hidden(tokens, cache)
    stepped = mx.concatenate([model.logits(forward.hidden(mx.array([[t]]), steps)) for t in rows], axis=1)
    verified = verify_logits(model, forward.hidden(mx.array([rows]), verify, verify=True), forward.verify)
    assert mx.array_equal(stepped.view(mx.uint16), verified.view(mx.uint16)).item()

    engine.loaded.eos_token_ids = frozenset()
    prompt = loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")[:11]
    plain = engine.complete(GenerationRequest(prompt, max_tokens=16, native_mtp="off"))
    accepted = 0
    for depth in (1, 2, 3, None):
        mtp = engine.complete(GenerationRequest(prompt, max_tokens=16, native_mtp="on", mtp_k=depth))
        assert mtp.token_ids == plain.token_ids, depth
        accepted += mtp.stats.accepted_tokens
    assert accepted > 0


def test_exo_qgemv_0_keeps_mlx_products(monkeypatch):
    layer = _layer(64, 128, 4, 64, mx.bfloat16, mx.random.key(3))
    monkeypatch.setenv("EXO_QGEMV", "0")
    assert use_qgemv([layer]) == {} and type(layer) is nn.QuantizedLinear
    monkeypatch.delenv("EXO_QGEMV")  # the default: on MLX CUDA only
    assert use_qgemv([layer]) == {} and type(layer) is nn.QuantizedLinear
    monkeypatch.setenv("EXO_QGEMV", "always")
    found = use_qgemv([layer])
    assert list(found) == ["qgemv 128->64 4-bit g64 bfloat16"] and type(layer) is QGemvLinear


@pytest.mark.parametrize(("value", "mode"), [(None, "cuda"), ("", "cuda"), ("0", "off"), ("off", "off"),
                                             ("false", "off"), ("1", "cuda"), ("true", "cuda"), ("always", "always"),
                                             ("ALWAYS", "always")])
def test_the_kernel_is_on_for_mlx_cuda_unless_exo_qgemv_is_0(monkeypatch, value, mode):
    """On by default on MLX CUDA (a whole 9B decoded faster on it than on MLX's products once its wrapper kept its
    launch arguments: docs/performance.md); ``0`` keeps MLX's products, ``always`` runs it anywhere."""
    if value is None:
        monkeypatch.delenv("EXO_QGEMV", raising=False)
    else:
        monkeypatch.setenv("EXO_QGEMV", value)
    assert cuda_qgemv.mode() == mode


def test_calls_up_to_call_rows_take_the_kernel_and_longer_ones_mlx(monkeypatch):
    """A batch step of up to ``CALL_ROWS`` sequences (or a short prompt chunk) goes through the kernel in launches of
    ``MAX_ROWS`` (MLX's product re-read the weights per row there on an H200); a prompt's longer chunks keep MLX's
    product; a verify call or a batch-invariant step takes the kernel at any length."""
    layer = _layer(64, 128, 4, 64, mx.bfloat16, mx.random.key(5))
    monkeypatch.setenv("EXO_QGEMV", "always")
    use_qgemv([layer])
    taken: list[int] = []
    product = cuda_qgemv.module_product
    monkeypatch.setattr(cuda_qgemv, "module_product", lambda m, x: taken.append(x.size // x.shape[-1]) or product(m, x))
    rows = cuda_qgemv.CALL_ROWS
    for shape in [(1, 1, 128), (8, 1, 128), (rows, 1, 128), (1, rows, 128), (rows + 1, 1, 128), (1, 4 * rows, 128)]:
        x = (mx.random.normal(shape, key=mx.random.key(6)) * 0.5).astype(mx.bfloat16)
        out = layer(x)
        assert out.shape == (*shape[:-1], 64)
    assert taken == [1, 8, rows, rows]
    layer.exact_verify = True
    layer(mx.zeros((1, 4 * rows, 128), dtype=mx.bfloat16))
    assert taken[-1] == 4 * rows


def test_a_verify_call_sets_only_the_flags_it_changes(checkpoint, qgemv_everywhere, monkeypatch):
    """Around a verify call the backbone's flags (MoE routing, exact rows on the kernel, attention per row) are set
    where they change: a call of at most ``CALL_ROWS`` rows (one sequence's K + 1) leaves the kernel's layers
    alone (the kernel takes every such row anyway), a larger one (a batch's rounds) flags them all and the end
    of the call clears them; the MoE blocks are locked and unlocked with every call."""
    from exo.engine.models.layers import SparseMoeBlock

    loaded = load_checkpoint(checkpoint("qwen3_5_moe", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16"))
    model = loaded.model
    qgemv = [m for _, m in model.named_modules() if isinstance(m, QGemvLinear)]
    blocks = [m for _, m in model.named_modules() if isinstance(m, SparseMoeBlock)]
    assert qgemv and blocks
    writes: list[str] = []
    real = QGemvLinear.__setattr__
    monkeypatch.setattr(QGemvLinear, "__setattr__", lambda self, k, v: writes.append(k) or real(self, k, v))
    model.set_verify_mode("route_locked", False, rows=cuda_qgemv.CALL_ROWS)
    assert all(b.verify_mode == "route_locked" for b in blocks) and not writes
    assert not any(m.exact_verify for m in qgemv)
    model.set_verify_mode(None, False)
    assert all(b.verify_mode is None for b in blocks) and not writes
    model.set_verify_mode("route_locked", False, rows=cuda_qgemv.CALL_ROWS + 1)
    assert all(m.exact_verify for m in qgemv) and len(writes) == len(qgemv)
    model.set_verify_mode(None, False)
    assert not any(m.exact_verify for m in qgemv) and len(writes) == 2 * len(qgemv)
    model.set_verify_mode(None, False)  # nothing changes: nothing is written
    assert len(writes) == 2 * len(qgemv)
