"""Decoder layers as compiled calls (``models.compiled_layers``, ``EXO_COMPILED_LAYERS``; forced here on the CPU
with "always"): a decode step and a verify call give the op-by-op layers' bits, greedy output is unchanged, native
MTP stays exact through them, and what must stay op by op does."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, load_checkpoint
from exo.engine.ahead import Snapshot
from exo.engine.models import compiled_layers, layers

ARCHS = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
CHUNK = 8


def _engine(path, **config) -> Engine:
    loaded = dataclasses.replace(load_checkpoint(path), eos_token_ids=frozenset())
    return Engine(loaded, EngineConfig(**{"prefill_chunk": CHUNK, **config}))


def _prompt(engine: Engine, length: int) -> list[int]:
    return [(7 * i + 3) % engine.vocab_size for i in range(length)]


def _traced(engine: Engine) -> dict[tuple, set]:
    """Per compiled function kind ("gdn" recording or not, "tail"), the shapes its calls were traced for."""
    found: dict[tuple, set] = {}
    for layer in engine.model.stage_layers:
        steps = layer.__dict__.get("_compiled_layer_steps", {})
        for name, value in steps.items():
            if name[0] == "gdn-structure":
                found.setdefault(("gdn", name[1]), set()).update(value)
            elif name[0] in ("tail", "heads", "after-attention") and value is not None:
                found.setdefault((name[0],), set())
    return found


def _forget(engine: Engine) -> None:
    for layer in engine.model.stage_layers:
        layer.__dict__.pop("_compiled_layer_steps", None)


@pytest.mark.parametrize(("dtype", "paths"), [("float32", "cpu"), ("bfloat16", "cpu"), ("bfloat16", "cuda")])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_compiled_step_and_verify_call_give_the_op_by_op_bits(checkpoint, arch, dtype, paths, monkeypatch):
    """One decode step and one recorded verify call of 3 rows, op by op and compiled, from the same caches: the
    hidden states, every cache array after, and the verify call's recorded rows are the same bits. ``cuda``: the
    layers wired as on MLX CUDA (exo's GatedDeltaNet step kernel and attention kernel, their references standing in
    on this CPU: a verify call's states recorded stacked, the attention's projections and output compiled apart;
    in bfloat16, the kernels' type)."""
    if paths == "cuda":
        monkeypatch.setenv("EXO_GDN_KERNEL", "always")
        monkeypatch.setenv("EXO_ATTN_KERNEL", "always")
    engine = _engine(checkpoint(arch, dtype=dtype))
    if paths == "cuda":
        assert engine.loaded.gdn and engine.loaded.attn and all(v.startswith("ok") for v in engine.loaded.gdn.values())
    forward, model = engine.forward, engine.model
    cache = forward.new_cache()
    mx.eval(forward.hidden(mx.array([_prompt(engine, 13)], dtype=mx.uint32), cache))
    snapshot = Snapshot(cache)

    def run(tokens: list[int], verify: bool) -> list[mx.array]:
        ids = mx.array([tokens], dtype=mx.uint32)
        if verify:
            model.set_verify_mode(engine.verify_mode.moe, engine.verify_mode.per_row_attention, len(tokens))
            for c in cache:
                if isinstance(c, layers.RollbackArraysCache):
                    c.recording = True
        try:
            hidden = forward.hidden(ids, cache, verify=verify)
            out = [hidden, model.logits(hidden)]
            for c in cache:
                out += [a for a in (c[0], c[1]) if a is not None] if isinstance(c, layers.RollbackArraysCache) else []
                out += (c.pending_arrays() if isinstance(c, layers.RollbackArraysCache)
                        else [a for a in c.state if isinstance(a, mx.array)])
            mx.eval(out)
            return out
        finally:
            for c in cache:
                if isinstance(c, layers.RollbackArraysCache):
                    c.recording = False
                    c.discard()
            if verify:
                model.set_verify_mode(None)
            snapshot.restore()

    for tokens, verify in (([5], False), ([5, 9, 2], True)):
        monkeypatch.setattr(compiled_layers, "MODE", "off")
        expected = run(tokens, verify)
        monkeypatch.setattr(compiled_layers, "MODE", "always")
        got = run(tokens, verify)
        assert len(got) == len(expected)
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item(), (verify, i)
    traced = _traced(engine)
    assert traced[("gdn", False)] == {(1, 1, model.hidden_size)}  # the decode step went through the compiled layers
    assert traced[("gdn", True)] == {(1, 3, model.hidden_size)}  # so did the verify call's rows
    # attention layers' dense MLPs (the MoE fixtures: none), around the attention kernel where it runs
    dense_attention = arch == "qwen3_5"
    assert (("tail",) in traced) == (dense_attention and paths == "cpu")
    assert (("heads",) in traced and ("after-attention",) in traced) == (dense_attention and paths == "cuda")


@pytest.mark.parametrize(("arch", "dtype", "paths"), [*((a, "float32", "cpu") for a in ARCHS),
                                                      ("qwen3_5", "bfloat16", "cuda"), ("qwen3_next", "bfloat16", "cuda")])
def test_compiled_layers_decode_as_before_and_mtp_stays_exact(checkpoint, arch, dtype, paths, monkeypatch):
    """Greedy plain decoding through compiled layers gives the op-by-op tokens; native MTP at K = 1, 3 and
    adaptive gives plain decoding's tokens through them, its verify calls' rows compiled too. ``cuda``: wired as
    on MLX CUDA (the kernels' references standing in, as in the test above)."""
    if paths == "cuda":
        monkeypatch.setenv("EXO_GDN_KERNEL", "always")
        monkeypatch.setenv("EXO_ATTN_KERNEL", "always")
    engine = _engine(checkpoint(arch, dtype=dtype))
    prompts = [_prompt(engine, n) for n in (CHUNK - 1, 2 * CHUNK + 3)]

    def greedy(prompt: list[int], **request) -> list[int]:
        return engine.complete(GenerationRequest(prompt, max_tokens=20, **request)).token_ids

    monkeypatch.setattr(compiled_layers, "MODE", "off")
    before = [greedy(p, native_mtp="off") for p in prompts]
    assert not _traced(engine)
    monkeypatch.setattr(compiled_layers, "MODE", "always")
    assert [greedy(p, native_mtp="off") for p in prompts] == before
    assert _traced(engine)[("gdn", False)] == {(1, 1, engine.model.hidden_size)}
    for depth in (1, 3, None):
        for prompt, expected in zip(prompts, before, strict=True):
            assert greedy(prompt, native_mtp="on", mtp_k=depth) == expected, depth
    verified = {shape[1] for shape in _traced(engine)[("gdn", True)]}
    assert {2, 4} <= verified, verified  # K = 1 and K = 3 verify calls


def test_prompts_and_batch_invariant_steps_stay_op_by_op_and_a_batch_s_step_compiles(checkpoint, monkeypatch):
    """A prompt chunk longer than ``MAX_ROWS`` and a batch-invariant step: no compiled call (a trace per length;
    flags that change the path). A decode step of two sequences: compiled (a trace of its own), the op-by-op
    bits."""
    monkeypatch.setattr(compiled_layers, "MODE", "always")
    engine = _engine(checkpoint("qwen3_5", dtype="float32"), prefill_chunk=64)
    forward, model = engine.forward, engine.model
    cache = forward.new_cache()
    mx.eval(forward.hidden(mx.array([_prompt(engine, compiled_layers.MAX_ROWS + 1)], dtype=mx.uint32), cache))
    assert not _traced(engine)  # the prompt
    model.set_batch_invariant(True)
    try:
        assert compiled_layers.mode_key(model) is None
    finally:
        model.set_batch_invariant(False)
    assert compiled_layers.mode_key(model) is not None
    monkeypatch.setattr(compiled_layers, "MODE", "cuda")  # the default: this CPU is not MLX CUDA
    assert compiled_layers.mode_key(model) is None
    assert compiled_layers.describe() == "cuda (off here)"
    two = forward.new_cache()
    mx.eval(forward.hidden(mx.array([_prompt(engine, 5), _prompt(engine, 9)[4:]], dtype=mx.uint32), two))
    snapshot = Snapshot(two)
    steps = []
    for mode in ("off", "always"):
        monkeypatch.setattr(compiled_layers, "MODE", mode)
        hidden = forward.hidden(mx.array([[3], [4]], dtype=mx.uint32), two)
        steps.append([hidden, *(a for c in two for a in (c.state if isinstance(c, layers.RollbackArraysCache)
                                                          else c.state[:2]) if isinstance(a, mx.array))])
        mx.eval(steps[-1])
        snapshot.restore()
    assert all(mx.array_equal(a, b).item() for a, b in zip(*steps, strict=True))
    assert _traced(engine)[("gdn", False)] == {(2, 1, model.hidden_size)}
    _forget(engine)


def test_a_kernel_switch_or_verify_state_gets_its_own_trace(checkpoint, monkeypatch):
    """A traced function bakes in the path its trace took: switching a kernel off (the benchmarks' A/B) or a
    verify state gives another function, not the stale one."""
    monkeypatch.setattr(compiled_layers, "MODE", "always")
    engine = _engine(checkpoint("qwen3_5", dtype="float32"))
    model = engine.model
    key = compiled_layers.mode_key(model)
    for switch, off in (("GDN_KERNEL_ON", False), ("QGEMV_ON", False), ("COMPILED_ROWS", "off")):
        on = getattr(layers, switch)
        monkeypatch.setattr(layers, switch, off)
        assert compiled_layers.mode_key(model) != key, switch
        monkeypatch.setattr(layers, switch, on)
    from exo.engine.models import prompt_dense

    head = compiled_layers.head_key()
    with prompt_dense.suspended():  # (a batch step's products dense or not: EXO_BATCH_DENSE)
        assert compiled_layers.mode_key(model) != key and compiled_layers.head_key() != head
    model.set_verify_mode(engine.verify_mode.moe or "route_locked", False, 3)
    try:
        assert compiled_layers.mode_key(model) != key
    finally:
        model.set_verify_mode(None)
    assert compiled_layers.mode_key(model) == key


def test_a_layer_mlx_cannot_trace_goes_op_by_op_and_mtp_stays_exact(checkpoint, monkeypatch, caplog):
    """MLX 0.32's compile fails to trace an MLP whose products run row by row in a verify call (a device whose
    products round a block of rows unlike one row, ``verify.probe``; exaggerated here as in test_generation.py):
    that layer's verify calls go op by op from then on, with a warning, and greedy MTP still equals plain
    decoding."""
    from .test_generation import _RoundsBlocksDifferently

    monkeypatch.setattr(compiled_layers, "MODE", "always")
    monkeypatch.setenv("EXO_FUSED_INPUTS", "0")  # the MLPs' own up projections, the layers this test swaps
    real = layers.vector_matmul
    monkeypatch.setattr(layers, "vector_matmul", lambda x, w: real(x, w) * (1.05 if x.size > x.shape[-1] else 1.0))
    loaded = dataclasses.replace(load_checkpoint(checkpoint("qwen3_5", dtype="float32")), eos_token_ids=frozenset())
    for layer in loaded.model.stage_layers:
        layer.mlp.up_proj.__class__ = _RoundsBlocksDifferently
    engine = Engine(loaded, EngineConfig(prefill_chunk=CHUNK))
    assert engine.verify_mode.per_row_linears > 0
    prompt = _prompt(engine, 11)
    plain = engine.complete(GenerationRequest(prompt, max_tokens=16, native_mtp="off")).token_ids
    with caplog.at_level("WARNING", logger=compiled_layers.__name__):
        for depth in (1, 3):
            assert engine.complete(GenerationRequest(prompt, max_tokens=16, mtp_k=depth)).token_ids == plain, depth
    gave_up = [(layer, name) for layer in engine.model.stage_layers
               for name, step in layer.__dict__.get("_compiled_layer_steps", {}).items() if step is None]
    # verify calls only (recording; an attention layer's MLP after its attention, under the verify state: the key's
    # fourth part, ``mode_key``)
    assert gave_up and all(name[1] if name[0] == "gdn" else name[1][3][0] is not None for _, name in gave_up)
    assert "op by op from now on" in caplog.text
    assert _traced(engine)[("gdn", False)]  # the decode steps stayed compiled


def test_the_setting_defaults_to_mlx_cuda_and_switches_off():
    """``EXO_COMPILED_LAYERS``: unset (or ``1``, ``cuda``) is on MLX CUDA, ``0`` / ``off`` never, ``always`` anywhere."""
    assert [compiled_layers.parse_mode(v) for v in ("", "1", "cuda", "CUDA")] == ["cuda"] * 4
    assert [compiled_layers.parse_mode(v) for v in ("0", "off", " Off ")] == ["off"] * 3
    assert compiled_layers.parse_mode("always") == "always"


@pytest.mark.parametrize("paths", ["cpu", "cuda"])
def test_the_mtp_head_through_compiled_calls_gives_its_op_by_op_bits(checkpoint, paths, monkeypatch):
    """The MTP head's decoder layer (``models.mtp``) runs through the compiled calls: a catch-up of several rows and
    chained one-row drafts give the op-by-op head's bits, its cache alike; ``cuda``: wired as on MLX CUDA (the
    attention kernel's reference standing in). The layer was traced (the compiled path ran)."""
    if paths == "cuda":
        monkeypatch.setenv("EXO_ATTN_KERNEL", "always")
    loaded = load_checkpoint(checkpoint("qwen3_5", dtype="bfloat16"))
    head, model = loaded.head, loaded.model
    hidden = mx.random.normal((1, 5, model.hidden_size), key=mx.random.key(3)).astype(mx.bfloat16)
    tokens = mx.array([[3, 9, 27, 81, 43]], dtype=mx.uint32)
    outputs = {}
    for mode in ("off", "always"):
        monkeypatch.setattr(compiled_layers, "MODE", mode)
        from mlx_lm.models.cache import KVCache

        cache = KVCache()
        out = head(model.embed(tokens), hidden, cache)  # a catch-up of 5 rows
        chain = [out]
        for token in (11, 12):  # chained drafts: one row each
            chain.append(head(model.embed(mx.array([[token]], dtype=mx.uint32)), chain[-1][:, -1:], cache))
        mx.eval(chain, cache.state)
        outputs[mode] = (chain, cache.state)
    for a, b in zip(outputs["off"][0], outputs["always"][0], strict=True):
        assert mx.array_equal(a, b).item()
    for a, b in zip(outputs["off"][1], outputs["always"][1], strict=True):
        assert mx.array_equal(a, b).item()
    steps = head.layers[0].__dict__.get("_compiled_layer_steps", {})
    assert {name[0] for name, f in steps.items() if f is not None} == (
        {"tail"} if paths == "cpu" else {"heads", "after-attention"})  # (MLX CUDA's kernel takes a catch-up's rows too)
