"""The engine's warm-up runs the products a batch will reach (engine/kernel_warmup.py), so MLX CUDA compiles their
kernels at load rather than inside a serving step (issue 51's stall: a batch's first step past 7 rows waited on
the compile of MLX's tiled quantized product)."""

from __future__ import annotations

import mlx.nn as nn
import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, kernel_warmup, load_checkpoint
from exo.engine.kernel_warmup import ROWS, warm_products
from exo.engine.models.layers import SparseMoeBlock


def _router(block: SparseMoeBlock) -> nn.Module:
    return block.gates_fused if block.fused_inputs is not None else block.gate  # (models.fused_inputs)


def _spy(monkeypatch) -> list[tuple[str, tuple, int]]:
    """(kind, weight shape, rows) of every call the warm-up makes."""
    seen = []
    linear, embedding, moe = nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear, SparseMoeBlock.__call__
    monkeypatch.setattr(nn.QuantizedLinear, "__call__",
                        lambda self, x: seen.append(("linear", tuple(self.weight.shape), x.shape[0])) or linear(self, x))
    monkeypatch.setattr(nn.QuantizedEmbedding, "as_linear",
                        lambda self, x: seen.append(("embedding", tuple(self.weight.shape), x.shape[0]))
                        or embedding(self, x))
    monkeypatch.setattr(SparseMoeBlock, "__call__",
                        lambda self, x, *a, **k: seen.append(("moe", tuple(_router(self).weight.shape), x.shape[0]))
                        or moe(self, x, *a, **k))
    return seen


def test_every_quantized_shape_and_moe_block_runs_once_at_each_tile_s_row_count(checkpoint, monkeypatch):
    loaded = load_checkpoint(checkpoint("qwen3_5_moe", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16"))
    modules = [loaded.model, loaded.head]
    shapes = {tuple(m.weight.shape) for tree in modules for _, m in tree.named_modules()
              if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.weight.ndim == 2}
    seen = _spy(monkeypatch)
    seconds = warm_products(modules, force=True)
    assert set(seconds) == {"quantized products", "moe blocks"}
    top = [(kind, shape, rows) for kind, shape, rows in seen if rows in ROWS]
    # each distinct shape at each row count, the MoE block too (its own products run inside it)
    outer = {(shape, rows) for kind, shape, rows in top if kind in ("linear", "embedding")}
    assert {shape for shape, _ in outer} == shapes
    assert all((shape, rows) in outer for shape in shapes for rows in ROWS)
    assert {rows for kind, _, rows in top if kind == "moe"} == set(ROWS)


def test_the_engine_s_warm_up_runs_it_on_mlx_cuda_only(checkpoint, monkeypatch):
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16"))
    seen = _spy(monkeypatch)
    Engine(loaded, EngineConfig()).warmup()  # this CPU: nothing warmed
    assert not [rows for _, _, rows in seen if rows in ROWS]
    monkeypatch.setattr(kernel_warmup, "on_cuda", lambda: True)  # as on MLX CUDA
    engine = Engine(loaded, EngineConfig())
    seen.clear()
    engine.warmup()
    assert {rows for _, _, rows in seen} >= set(ROWS)
    assert "quantized products" in engine.warmup_seconds


def test_layers_on_exo_s_quantized_kernel_also_run_at_every_launch_row_count(checkpoint, monkeypatch):
    """exo's kernel is compiled per row count of a launch (1-8: a batch of 13 runs launches of 8 and 5) and MLX keeps
    none of a custom kernel's compiles between processes: the warm-up runs each such layer at every count, so no
    batch size compiles one inside a step."""
    from exo.engine.kernels.cuda_qgemv import MAX_ROWS
    from exo.engine.models.layers import QGemvLinear

    monkeypatch.setenv("EXO_QGEMV", "always")
    loaded = load_checkpoint(checkpoint("qwen3_5", layout="mlx_q4_sidecar", head="trained", dtype="bfloat16"))
    assert loaded.qgemv and all(v.startswith("ok") for v in loaded.qgemv.values())
    counted: dict[tuple, set[int]] = {}
    call = QGemvLinear.__call__
    monkeypatch.setattr(QGemvLinear, "__call__", lambda self, x: counted.setdefault(
        tuple(self.weight.shape), set()).add(x.shape[0]) or call(self, x))
    warm_products([loaded.model], force=True)
    assert counted and all(rows >= set(range(1, MAX_ROWS + 1)) | set(ROWS) for rows in counted.values())


def test_a_batch_grows_to_max_batch_one_step_a_size_shrinks_and_leaves_the_engine_as_it_was(checkpoint, monkeypatch):
    from exo.engine import GenerationRequest
    from exo.engine.batch import BatchLanes
    from exo.engine.kernel_warmup import warm_batches

    engine = Engine(load_checkpoint(checkpoint("qwen3_5")), EngineConfig())
    request = GenerationRequest([5, 9, 2, 7], max_tokens=12)
    before = [t for chunk in engine.generate(request) for t in chunk.token_ids]
    sizes = []
    step = BatchLanes.step
    monkeypatch.setattr(BatchLanes, "step", lambda self: sizes.append(len(self)) or step(self))
    assert warm_batches(engine, 1, force=True) is None  # a server of one at a time: nothing to warm
    assert warm_batches(engine, 5) is None  # on the CPU MLX compiles nothing at these points
    assert sizes == []
    seconds = warm_batches(engine, 5, force=True)
    assert seconds is not None and seconds > 0
    assert sizes == [2, 3, 4, 5, 4, 3, 2]  # grown one member a step, then members taken out
    assert [t for chunk in engine.generate(request) for t in chunk.token_ids] == before
    monkeypatch.setattr(kernel_warmup, "on_cuda", lambda: True)
    engine.forward.stages = 2  # a pipeline stage: its steps need every stage
    assert warm_batches(engine, 5) is None


def test_a_served_engine_warms_its_batches_at_load(checkpoint, monkeypatch, tmp_path):
    from exo.runner.loading import ready_engine
    from exo.settings import Settings

    monkeypatch.setattr(kernel_warmup, "on_cuda", lambda: True)  # as on MLX CUDA
    settings = Settings(max_batch=3, home=tmp_path)
    engine = ready_engine(load_checkpoint(checkpoint("qwen3_5")), EngineConfig(), settings)
    assert engine.warmup_seconds["batch steps"] > 0


def test_the_batch_grows_only_as_far_as_the_kv_budget_admits_and_running_out_of_memory_skips_the_rest(
        checkpoint, monkeypatch, caplog):
    from exo.engine.batch import BatchLanes
    from exo.engine.batch_memory import batch_fits, sequence_bytes
    from exo.engine.kernel_warmup import warm_batches

    engine = Engine(load_checkpoint(checkpoint("qwen3_5")), EngineConfig())
    per_token, per_sequence = sequence_bytes(engine)
    horizon = 3 + 6 + 2
    budget = (3 * (horizon * per_token + per_sequence)) // per_token + 1  # three members fit, four do not
    assert batch_fits(engine, [horizon] * 3, budget) and not batch_fits(engine, [horizon] * 4, budget)
    sizes = []
    step = BatchLanes.step
    monkeypatch.setattr(BatchLanes, "step", lambda self: sizes.append(len(self)) or step(self))
    assert warm_batches(engine, 6, budget, force=True) is not None
    assert sizes == [2, 3, 2, 1]
    assert warm_batches(engine, 6, 1, force=True) is None  # not even two fit

    def out_of_memory(self):
        if len(self) == 3:
            raise RuntimeError("[cuda::malloc] Out of memory: failed to allocate 1 GB")
        return step(self)

    sizes.clear()
    monkeypatch.setattr(BatchLanes, "step", out_of_memory)
    with caplog.at_level("WARNING"):
        assert warm_batches(engine, 6, force=True) is not None  # the load goes on
    assert "ran out of memory at 3 members" in caplog.text
    monkeypatch.setattr(BatchLanes, "step", lambda self: (_ for _ in ()).throw(RuntimeError("another failure")))
    with pytest.raises(RuntimeError, match="another failure"):
        warm_batches(engine, 6, force=True)
    request = GenerationRequest([5, 9, 2, 7], max_tokens=6)
    assert [t for chunk in engine.generate(request) for t in chunk.token_ids]  # the engine serves on
