"""The prefix cache's tiers (runner/prefix_store.py): RAM and disk budgets, least recently used out first,
the disk tier across a restart, and a damaged file as a miss that is removed, never a wrong reply."""

from __future__ import annotations

import dataclasses
import os
import time

import mlx.core as mx
import pytest

from exo.engine import Engine, EngineConfig, GenerationRequest, SamplingParams, load_checkpoint
from exo.engine import prefix_cache as pc
from exo.runner.prefix_store import CorruptEntry, DiskTier, TieredStore, prepare, read_entry, write_entry
from exo.settings import load_settings


def _entry(seed: int, n: int = 64) -> dict[str, mx.array]:
    mx.random.seed(seed)
    arrays = {"k0": mx.random.normal((1, 2, n, 8)).astype(mx.bfloat16), "r1": mx.random.normal((1, 4, 8, 8))}
    mx.eval(list(arrays.values()))
    return arrays


def _equal(a, b) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and mx.array_equal(a[k], b[k]).item() for k in a)


def test_files_round_trip_bit_for_bit(tmp_path):
    arrays = _entry(0)
    path = tmp_path / "x.safetensors"
    write_entry(path, prepare(arrays))
    assert _equal(read_entry(path), arrays)
    # A standard safetensors file: MLX's own reader agrees.
    assert _equal(mx.load(str(path)), arrays)


@pytest.mark.parametrize("damage", ["truncate", "flip", "garbage"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, damage):
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put("ns/b-1", prepare(_entry(1)))
    path = tier._path("ns/b-1")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 100]
    elif damage == "flip":
        data[-5] ^= 0xFF
    else:
        data = bytearray(b"not a safetensors file")
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptEntry):
        read_entry(path)
    assert tier.get("ns/b-1") is None
    assert not path.exists() and not tier.has("ns/b-1") and tier.bytes == 0
    assert tier.counts.corrupt == 1


def test_disk_budget_least_recently_used_out_and_restart(tmp_path):
    size = DiskTier(tmp_path / "probe", 1 << 30)
    size.put("a", prepare(_entry(0)))
    one = size.bytes
    tier = DiskTier(tmp_path / "d", 3 * one)
    past = time.time_ns() - 100 * 10**9  # distinct times in the past (a rescan orders by them; d is newest)
    for i, key in enumerate(["a", "b", "c"]):
        tier.put(key, prepare(_entry(i)))
        os.utime(tier._path(key), ns=(past + i * 10**9,) * 2)
    assert tier.get("a") is not None  # a is now the most recent
    os.utime(tier._path("a"), ns=(past + 5 * 10**9,) * 2)
    tier.put("d", prepare(_entry(3)))
    assert not tier.has("b") and tier.has("a") and tier.has("c") and tier.has("d")
    assert tier.counts.evictions == 1 and tier.bytes <= 3 * one
    again = DiskTier(tmp_path / "d", 2 * one)  # a restart with a smaller budget: the oldest (c) goes
    assert sorted(again.keys()) == ["a", "d"]
    assert _equal(again.get("d"), _entry(3))


def test_two_instances_of_a_model_share_its_directory(tmp_path):
    """Two runners of one model on a node (or one and its restart) use one directory: what one wrote is a hit
    in the other, what one evicted is an ordinary miss in the other (not a corrupt one), and every file counts
    once against the budget, whoever wrote it."""
    one = DiskTier(tmp_path / "probe", 1 << 30)
    one.put("k", prepare(_entry(0)))
    size = one.bytes
    a, b = DiskTier(tmp_path / "d", 2 * size), DiskTier(tmp_path / "d", 2 * size)
    a.rescan_s = b.rescan_s = 0.0  # re-read the directory at every write (RESCAN_S apart in a runner)
    past = time.time_ns() - 100 * 10**9
    a.put("k0", prepare(_entry(0)))
    assert b.has("k0") and _equal(b.get("k0"), _entry(0))  # written after b opened the directory
    assert b.counts.hits == 1 and b.bytes == a.bytes == size
    b.put("k1", prepare(_entry(1)))
    os.utime(b._path("k1"), ns=(past,) * 2)  # k1 is the least recently used
    a.put("k2", prepare(_entry(2)))  # a's view: k0, k1 (b's), k2 = 3 files > 2: k1 goes
    assert not (tmp_path / "d" / "k1.safetensors").exists() and a.bytes == 2 * size
    assert a.counts.evictions == 1
    assert b.get("k1") is None and not b.has("k1")
    assert b.counts.corrupt == 0 and b.counts.misses == 1
    b.put("k3", prepare(_entry(3)))
    on_disk = sorted(f.name for f in (tmp_path / "d").iterdir())
    assert len(on_disk) == 2 and b.bytes == sum(f.stat().st_size for f in (tmp_path / "d").iterdir()) == 2 * size
    assert "k3.safetensors" in on_disk and _equal(a.get("k3"), _entry(3))


def test_only_a_stale_temporary_file_is_removed(tmp_path):
    """A temporary file is another instance's write in progress unless it is old (a write cut short)."""
    live, stale = tmp_path / "k.safetensors.1-2.tmp", tmp_path / "j.safetensors.1-2.tmp"
    live.write_bytes(b"half")
    stale.write_bytes(b"half")
    os.utime(stale, ns=(time.time_ns() - 3600 * 10**9,) * 2)
    DiskTier(tmp_path, 1 << 20)
    assert live.exists() and not stale.exists()


def test_ram_tier_spills_to_disk_and_promotes_on_a_hit(tmp_path):
    one = pc.nbytes(_entry(0))
    store = TieredStore(2 * one, DiskTier(tmp_path, 1 << 30))
    for i in range(3):
        store.put(f"k{i}", _entry(i))
    store.flush()
    assert not store.ram.has("k0") and store.has("k0")  # out of RAM, still on disk
    assert store.ram_counts.evictions == 1
    assert _equal(store.get("k0"), _entry(0))
    assert store.ram.has("k0") and store.disk is not None and store.disk.counts.hits == 1
    figures = store.figures()
    assert figures["ram_bytes"] == 2 * one and figures["disk_bytes"] > 3 * one
    store.close()


def test_the_next_turn_after_a_restart_restores_from_disk(checkpoint, tmp_path):
    loaded = dataclasses.replace(load_checkpoint(checkpoint("qwen3_5_moe", dtype="float32")), eos_token_ids=frozenset())
    settings = load_settings(env={"EXO_HOME": str(tmp_path), "EXO_PREFIX_CACHE_BLOCK_TOKENS": "16",
                                  "EXO_PREFIX_CACHE_RAM_BYTES": "0"})
    from exo.runner.prefix_store import open_prefix_cache

    def engine(cached: bool) -> Engine:
        e = Engine(loaded, EngineConfig(prefill_chunk=32))
        e.prefix_cache = open_prefix_cache(loaded, settings) if cached else None
        return e

    tokenizer = loaded.tokenizer
    system = {"role": "system", "content": "You are an agent with tools: ls, cat, grep. " * 4}
    turn1 = [system, {"role": "user", "content": "What is in src?"}]
    turn2 = turn1 + [{"role": "assistant", "content": "Let me look."}, {"role": "user", "content": "src has a.py"}]
    p1 = list(tokenizer.apply_chat_template(turn1, add_generation_prompt=True))
    p2 = list(tokenizer.apply_chat_template(turn2, add_generation_prompt=True))
    greedy = dict(max_tokens=10, sampling=SamplingParams(temperature=0.0), mtp_k=2)
    first = engine(True)
    first.complete(GenerationRequest(p1, **greedy))
    first.prefix_cache.store.close()  # the runner's graceful exit: writes finished
    restarted = engine(True)
    assert restarted.prefix_cache.store.ram.bytes == 0
    hit = restarted.complete(GenerationRequest(p2, **greedy))
    cold = engine(False).complete(GenerationRequest(p2, **greedy))
    header = max(i for i, t in enumerate(p1) if t in restarted.prefix_cache.starts)  # turn 1's generation header
    assert p2[: len(p1)] == p1 and hit.stats.cached_tokens == header
    assert hit.token_ids == cold.token_ids
    assert (hit.stats.drafted_tokens, hit.stats.accepted_tokens) == (cold.stats.drafted_tokens, cold.stats.accepted_tokens)
    assert hit.stats.prefix_cache is not None and hit.stats.prefix_cache["disk_hits"] > 0
    # Another model (or stage) never sees these entries.
    other = dataclasses.replace(loaded, model_id="another")
    assert pc.namespace(other) != pc.namespace(loaded)
    assert pc.namespace(loaded, (0, 2)) != pc.namespace(loaded)
    restarted.prefix_cache.store.close()


def test_the_ram_budget_shrinks_to_what_the_node_has_free(tmp_path):
    """The RAM tier never takes what placement promised the instance: min(the setting, free - reserve)."""
    from exo.runner.prefix_store import ram_budget

    settings = load_settings(env={"EXO_HOME": str(tmp_path), "EXO_PREFIX_CACHE_RAM_BYTES": str(64 << 20)})
    assert ram_budget(settings, reserve_bytes=1 << 30, available_bytes=(1 << 30) + (3 << 20)) == 3 << 20
    assert ram_budget(settings, reserve_bytes=1 << 30, available_bytes=8 << 30) == 64 << 20
    assert ram_budget(settings, reserve_bytes=1 << 30, available_bytes=512 << 20) == 0


def test_a_served_engine_gets_the_shrunk_budget_and_reports_it(checkpoint, tmp_path):
    """``ready_engine`` (the runner's and the local service's) counts the instance's KV budget and activation
    margin before the RAM tier: on a node whose memory is its weights + that + 3 MiB, the tier gets 3 MiB."""
    from exo.cards.schema import CONTEXT_BUDGET_TOKENS
    from exo.cluster.placement import ACTIVATION_MARGIN_BYTES
    from exo.engine.batch import sequence_bytes
    from exo.runner.loading import ready_engine, reserve_bytes

    loaded = load_checkpoint(checkpoint("qwen3_5"))
    env = {"EXO_HOME": str(tmp_path), "EXO_PREFIX_CACHE_RAM_BYTES": str(1 << 30), "EXO_KV_BUDGET_TOKENS": "4096"}
    probe = Engine(loaded, EngineConfig())
    per_token, per_sequence = sequence_bytes(probe)
    reserve = reserve_bytes(probe, load_settings(env=env))
    assert per_token > 0 and reserve == per_token * 4096 + per_sequence + ACTIVATION_MARGIN_BYTES
    assert reserve_bytes(probe, load_settings(env={**env, "EXO_KV_BUDGET_TOKENS": ""})) >= per_token * CONTEXT_BUDGET_TOKENS
    # memory_budget_bytes caps what the node reports free, as placement reads it.
    settings = load_settings(env={**env, "EXO_MEMORY_BUDGET_BYTES": str(reserve + (3 << 20))})
    engine = ready_engine(loaded, EngineConfig(), settings)
    assert engine.prefix_cache is not None
    assert engine.prefix_cache.store.ram.budget_bytes == 3 << 20
    figures = engine.prefix_cache.figures()
    assert figures["ram_budget_bytes"] == 3 << 20 and figures["disk_budget_bytes"] == settings.prefix_cache_disk_bytes
    engine.prefix_cache.store.close()
