"""One model across several processes by tensor (engine/sharding.py, engine/tensor.py): every member holds a
slice of every layer (attention and GatedDeltaNet heads, MLP and expert columns), joined by all-reduces.

The slicing rules are checked in one process: the members' slices, their partial sums added as the all-reduce
adds them, compute the whole model (float32: to rounding). The rest runs real groups: one process per member
on 127.0.0.1 over MLX's ring backend (exo.runner.local_pipeline). Within a tensor group, greedy native MTP gives
the group's own plain decoding token for token at every depth and adaptive (each member rolls back its own
heads' caches on the leader's decision), a batch gives each member its solo output, and a prefix-cache hit
equals the cold prompt. Against one node the sums round in another order: that rate is measured, not asserted
(bench/tensor.py, docs/cluster.md)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_map
from mlx_lm.models.base import create_attention_mask, create_ssm_mask

from exo.cards import bundled_model_dir
from exo.engine import load_checkpoint
from exo.engine.sharding import (
    TensorShardingError,
    TensorShare,
    member_process_settings,
    split_problem,
    tensor_node_counts,
)
from exo.runner.local_pipeline import run_local_tensor
from tests.fixtures.engines import fresh_engine

CHUNK = 8
MAX_TOKENS = 16
DEPTHS = (1, 2, 3, None)


def _float32(loaded):
    loaded.model.update(tree_map(lambda a: a.astype(mx.float32) if a.dtype == mx.bfloat16 else a,
                                 loaded.model.parameters()))
    return loaded


def _composed(parts, tokens):
    """The members' slices run layer by layer, each layer's partial outputs summed (what the all-reduce does)."""
    caches = [p.model.make_cache() for p in parts]
    x = parts[0].model.text_model.embed_tokens(tokens)
    for i, first in enumerate(parts[0].model.text_model.layers):
        layers = [p.model.text_model.layers[i] for p in parts]
        mask = (create_ssm_mask if first.is_linear else create_attention_mask)(x, caches[0][i])
        mixed = [(layer.linear_attn if layer.is_linear else layer.self_attn)(layer.input_layernorm(x), mask, c[i])
                 for layer, c in zip(layers, caches, strict=True)]
        h = x + sum(mixed[1:], mixed[0])
        mlps = [layer.mlp(layer.post_attention_layernorm(h)) for layer in layers]
        x = h + sum(mlps[1:], mlps[0])
    return parts[-1].model.text_model.norm(x)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_6_moe", "qwen3_next", "demo-moe"])
@pytest.mark.parametrize("nodes", [2, 4])
def test_the_members_slices_compose_to_the_whole_model(checkpoint, arch, nodes):
    # exo-demo-moe has 1 key/value head and 1 GatedDeltaNet key head: with 2 members each holds a copy of it.
    path = bundled_model_dir("exo-demo-moe") if arch == "demo-moe" else checkpoint(arch, dtype="float32")
    config = json.loads((path / "config.json").read_text())
    if nodes not in tensor_node_counts(config):
        with pytest.raises(TensorShardingError, match=f"over {nodes} nodes"):
            load_checkpoint(path, tensor=TensorShare(None, 0, nodes))
        return
    whole = _float32(load_checkpoint(path))
    parts = [_float32(load_checkpoint(path, tensor=TensorShare(None, r, nodes))) for r in range(nodes)]
    # The leader alone holds the output and the MTP head; every member the embedding (it embeds the step's ids).
    assert parts[-1].head is not None and parts[-1].tokenizer is not None
    assert all(p.head is None and p.tokenizer is None and not p.model.last_stage for p in parts[:-1])
    assert all("embed_tokens" in p.model.text_model for p in parts)
    tokens = mx.array([[5, 9, 13, 2, 7, 11, 3, 4, 8, 1, 6]])
    want = whole.model.hidden(tokens, whole.model.make_cache())
    got = _composed(parts, tokens)
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), mx.abs(got - want).max().item()
    # Each member's attention and GatedDeltaNet caches hold its own heads only.
    cache = parts[0].model.make_cache()
    parts[0].model.stage_hidden(tokens, cache)
    whole_cache = whole.model.make_cache()
    whole.model.hidden(tokens, whole_cache)
    for mine, full in zip(cache, whole_cache, strict=True):
        if hasattr(mine, "keys") and mine.keys is not None:
            assert mine.keys.shape[1] == max(1, full.keys.shape[1] // nodes)
        elif mine[1] is not None:
            assert mine[1].shape[1] == full[1].shape[1] // nodes


def test_the_rules_say_which_splits_a_checkpoint_allows(checkpoint):
    dense = json.loads((checkpoint("qwen3_5", dtype="float32") / "config.json").read_text())
    assert tensor_node_counts(dense) == [2, 4]  # 4 query / 2 key-value heads, 2 key / 4 value GatedDeltaNet heads
    assert "4 attention heads do not divide among 3 nodes" in split_problem(dense, 3)
    assert split_problem(dense, 1) is None
    # A 4-bit MoE fixture: 64 expert columns split in two are 32 a node, under a 64-wide quantization group.
    q4 = checkpoint("qwen3_5_moe", layout="mlx_q4")
    assert tensor_node_counts(json.loads((q4 / "config.json").read_text())) == []
    with pytest.raises(TensorShardingError, match="64-wide quantization groups"):
        load_checkpoint(q4, tensor=TensorShare(None, 1, 2))
    with pytest.raises(ValueError, match="by layers or by tensor"):
        load_checkpoint(q4, layers=(0, 2), tensor=TensorShare(None, 1, 2))


# -- real groups: one process per member -------------------------------------------------------------------


def _prompts(path, lengths):
    engine = fresh_engine(path, eos=False)
    ids = engine.loaded.tokenizer.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return fib")
    while len(ids) < max(lengths):
        ids = ids + ids
    return [ids[:n] for n in lengths]


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next", "demo-moe"])
def test_tensor_greedy_mtp_equals_its_own_plain_decoding(checkpoint, arch, record_property):
    path = bundled_model_dir("exo-demo-moe") if arch == "demo-moe" else checkpoint(arch, dtype="float32")
    prompts = _prompts(path, (CHUNK - 1, 2 * CHUNK + 3))  # one within a prefill chunk, one across two edges
    requests = [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "native_mtp": "off"} for p in prompts]
    requests += [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "mtp_k": k, "native_mtp": "on"}
                 for k in DEPTHS for p in prompts]
    run = run_local_tensor(path, 2, requests, prefill_chunk=CHUNK, timeout_s=300, collective_reps=1)
    out = run["results"]
    # (the group's collectives timed before it served: alone at a step's and a verify call's rows, and chained)
    assert set(run["collectives"]) == {"all_sum_1_row_us", "all_sum_4_row_us", "all_sum_chained_us"}, run
    assert all(v > 0 for v in run["collectives"].values()), run
    plains = {tuple(r["prompt"]): result["token_ids"] for r, result in zip(requests, out, strict=False)
              if r["native_mtp"] == "off"}
    drafted = accepted = 0
    for request, result in zip(requests, out, strict=True):
        where = (len(request["prompt"]), request.get("mtp_k"), request["native_mtp"])
        assert result["token_ids"] == plains[tuple(request["prompt"])], where
        stats = result["stats"]
        assert stats["mode"] == "tensor" and stats["stages"] == 2, stats
        assert stats["enabled"] == (request["native_mtp"] == "on"), where
        drafted += stats["drafted_tokens"]
        accepted += stats["accepted_tokens"]
    record_property("acceptance", accepted / drafted)
    assert drafted > 0 and 0 < accepted < drafted  # drafts were accepted and rejected: rollbacks on every member


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_a_tensor_group_through_compiled_layers_gives_its_op_by_op_tokens(checkpoint, arch):
    """Every member's layers as compiled calls (``EXO_COMPILED_LAYERS=always``; MLX CUDA's default) with the group's
    all-reduces inside them: plain decoding and native MTP give the op-by-op group's tokens; the members run with
    MLX CUDA's graphs off (``sharding.member_process_settings``) unless told otherwise."""
    path = checkpoint(arch, dtype="float32")
    prompts = _prompts(path, (CHUNK - 1, CHUNK + 3))
    requests = [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "native_mtp": "off"} for p in prompts]
    requests += [{"prompt": p, "max_tokens": MAX_TOKENS, "ignore_eos": True, "mtp_k": 2, "native_mtp": "on"}
                 for p in prompts]
    op_by_op = run_local_tensor(path, 2, requests, prefill_chunk=CHUNK, timeout_s=300,
                                stage_env=[{"EXO_COMPILED_LAYERS": "off"}, {"EXO_COMPILED_LAYERS": "off",
                                                                             "MLX_USE_CUDA_GRAPHS": "1"}])
    compiled = run_local_tensor(path, 2, requests, prefill_chunk=CHUNK, timeout_s=300,
                                stage_env=[{"EXO_COMPILED_LAYERS": "always"}] * 2)
    assert op_by_op["compiled_layers"] == 0 and compiled["compiled_layers"] > 0
    assert op_by_op["cuda_graphs"] == "1" and compiled["cuda_graphs"] == "0"  # (the user's setting stays)
    for request, a, b in zip(requests, op_by_op["results"], compiled["results"], strict=True):
        assert b["token_ids"] == a["token_ids"], (len(request["prompt"]), request["native_mtp"])
    assert sum(r["stats"]["drafted_tokens"] for r in compiled["results"]) > 0


def test_a_tensor_members_process_settings_leave_the_users_alone():
    env = {}
    assert member_process_settings(env) == {"MLX_USE_CUDA_GRAPHS": "0"} and env == {"MLX_USE_CUDA_GRAPHS": "0"}
    env = {"MLX_USE_CUDA_GRAPHS": "1"}
    assert member_process_settings(env) == {} and env == {"MLX_USE_CUDA_GRAPHS": "1"}


def test_a_tensor_batch_gives_every_member_its_solo_output(checkpoint):
    path = checkpoint("qwen3_5_moe", dtype="float32")
    prompts = _prompts(path, (5, CHUNK + 3, 2 * CHUNK + 1))
    solo = [{"prompt": p, "max_tokens": MAX_TOKENS + 2 * i, "ignore_eos": True, **mtp}
            for mtp in ({"native_mtp": "off"}, {"mtp_k": 2, "native_mtp": "on"}) for i, p in enumerate(prompts)]
    # Members join at different steps (a newcomer prefills beside the running batch) and leave at their budgets;
    # in the second batch the two that join first prefill as rows of one call (each row's length and owner in its
    # header, every member's heads split alike).
    batches = [{"batch": solo[:3], "join_at": [0, 2, 5]}, {"batch": solo[3:], "join_at": [0, 0, 3], "together": True}]
    out = run_local_tensor(path, 2, solo + batches, prefill_chunk=CHUNK, timeout_s=300)["results"]
    alone, together = out[: len(solo)], out[len(solo)][:] + out[len(solo) + 1][:]
    assert [b["together"] for b in together] == [False, False, False, True, True, False]
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert b["token_ids"] == a["token_ids"], i
        assert len(a["token_ids"]) == solo[i]["max_tokens"]
    assert sum(b["stats"]["drafted_tokens"] for b in together) > 0


SYSTEM = "You are a coding agent. Tools: read(path), write(path, text), run(cmd). " * 3


def test_a_tensor_prefix_cache_hit_equals_the_cold_prompt(checkpoint):
    path = checkpoint("qwen3_5", dtype="float32")
    tokenizer = fresh_engine(path).loaded.tokenizer

    def prompt(*turns):
        messages = [{"role": "system", "content": SYSTEM}] + [{"role": "user", "content": t} for t in turns]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))

    first, second = prompt("List the files in src"), prompt("List the files in src", "Now read main.py please")
    requests = [{"prompt": p, "max_tokens": 12, "ignore_eos": True, **mtp}
                for mtp in ({"native_mtp": "off"}, {"mtp_k": 2, "native_mtp": "on"}) for p in (first, second)]
    cold = run_local_tensor(path, 2, requests, prefill_chunk=24, timeout_s=300)
    warm = run_local_tensor(path, 2, requests, prefill_chunk=24, timeout_s=300,
                            prefix_cache={"block_tokens": 16, "min_snapshot_tokens": 8})
    for c, w in zip(cold["results"], warm["results"], strict=True):
        assert w["token_ids"] == c["token_ids"]
    # The second prompt restores what it shares with the first, MTP off and on (a drafting request restores only
    # what a drafting one stored: the head's cache with it).
    cached = [w["stats"]["cached_tokens"] for w in warm["results"]]
    assert cached[0] == cached[2] == 0 and cached[1] == cached[3] > len(first) // 2, cached
    follower, leader = warm["prefix"]
    # Each member stored its own slice's part and restored it for every hit the leader had.
    assert follower["captured_bytes"] > 0 and leader["captured_bytes"] > 0
    assert follower["hits"] == leader["hits"] == sum(n > 0 for n in cached)
