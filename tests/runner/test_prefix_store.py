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


def test_running_out_of_memory_while_reading_keeps_the_file(tmp_path, monkeypatch):
    """A read that runs out of memory says so (the cache counts it as a failed lookup); the file is sound, so
    it stays and is read the next time."""
    tier = DiskTier(tmp_path, 1 << 20)
    arrays = _entry(5)
    tier.put("ns/b-5", prepare(arrays))

    def no_memory(*args, **kwargs):
        raise MemoryError

    with monkeypatch.context() as m:
        m.setattr("exo.runner.prefix_store.np.frombuffer", no_memory)  # the outer edge: the process's memory
        with pytest.raises(MemoryError):
            tier.get("ns/b-5")
    assert tier._path("ns/b-5").exists() and tier.counts.corrupt == 0
    assert _equal(tier.get("ns/b-5"), arrays)


def test_a_stray_file_in_the_cache_directory_is_never_a_snapshot(tmp_path):
    """A restarted cache lists the snapshots on disk by their names; a file it did not write (named like one)
    is skipped, not a crash at startup."""
    tier = DiskTier(tmp_path, 1 << 20)
    tier.put("ns/s-300-abc", prepare(_entry(6)))
    tier.put("ns/s-bogus", prepare(_entry(7)))
    cache = pc.PrefixCache(TieredStore(1 << 20, tier), "ns")
    assert cache._lengths == {300} and cache.stats.failures == 0


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


def test_an_entry_on_its_way_to_disk_is_found_when_ram_let_it_go(tmp_path):
    """An entry RAM cannot keep (larger than its budget, or evicted by the next ones) and the writer has not
    written yet (behind, or waiting out a quiet lease while the next turn prefills) is still found: an agent's
    next turn asked at once hits, with the entry's exact arrays, and it is promoted to RAM as a disk hit is."""
    one = pc.nbytes(_entry(0))
    store = TieredStore(one - 1, DiskTier(tmp_path, 1 << 30))  # no entry fits in RAM
    store.quiet(30.0)  # the writer writes nothing meanwhile
    store.put("k0", _entry(0))
    assert not store.ram.has("k0") and store.disk is not None and not store.disk.has("k0")
    assert store.has("k0") and "k0" in store.keys()
    assert _equal(store.get("k0"), _entry(0)) and store.ram_counts.pending_hits == 1
    with store._quiet:  # the lease as if it ran out now
        store._quiet_until = time.monotonic()
        store._quiet.notify_all()
    store.flush()
    assert store.disk.has("k0") and not store._pending  # written: the disk serves it from now on
    assert _equal(store.get("k0"), _entry(0)) and store.disk.counts.hits == 1
    store.close()


def test_the_disk_writer_waits_out_a_quiet_lease_and_then_writes(tmp_path):
    """``quiet``: nothing reaches the disk while a lease runs (a prefill's chunks); the writes follow once it
    ends by itself; the RAM tier serves meanwhile."""
    store = TieredStore(1 << 30, DiskTier(tmp_path, 1 << 30))
    store.quiet(30.0)
    store.put("k0", _entry(0))
    time.sleep(0.3)  # the writer had its time: it must not have used it
    assert store.disk is not None and not store.disk.has("k0") and store.ram.has("k0") and store.has("k0")
    store.quiet(0.0)  # (no lease: leaves the one running as it is)
    assert not store.disk.has("k0")
    with store._quiet:  # the lease as if it ran out now
        store._quiet_until = time.monotonic() + 0.2
    begun = time.monotonic()
    store.flush()
    assert store.disk.has("k0") and time.monotonic() - begun >= 0.15
    store.close()


def test_a_prefill_takes_the_writers_quiet_lease_chunk_by_chunk(checkpoint, tmp_path):
    loaded = dataclasses.replace(load_checkpoint(checkpoint("qwen3_5", dtype="float32")), eos_token_ids=frozenset())
    settings = load_settings(env={"EXO_HOME": str(tmp_path), "EXO_PREFIX_CACHE_BLOCK_TOKENS": "16"})
    from exo.runner.prefix_store import open_prefix_cache

    engine = Engine(loaded, EngineConfig(prefill_chunk=16))
    engine.prefix_cache = open_prefix_cache(loaded, settings)
    store = engine.prefix_cache.store
    leases: list[float] = []
    real = store.quiet
    store.quiet = lambda seconds: leases.append(seconds) or real(seconds)
    prompt = list(range(5, 5 + 70))
    engine.complete(GenerationRequest(prompt, max_tokens=4, sampling=SamplingParams(temperature=0.0)))
    assert leases == [pc.QUIET_S] * 5  # one per chunk of 16 of the 70 tokens
    store.flush()  # the lease ran out by itself: everything stored is on disk
    assert store.disk is not None and store.disk.keys()
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
    first.complete(GenerationRequest(p1, prompt_cache_key="conv-1", **greedy))
    first.prefix_cache.store.close()  # the runner's graceful exit: writes finished
    restarted = engine(True)
    assert restarted.prefix_cache.store.ram.bytes == 0
    # Everything turn 1 stored is in its prompt_cache_key's group on disk, after the restart too.
    disk = restarted.prefix_cache.store.disk
    group = f"{pc.key_hash('conv-1'):016x}"
    assert disk.keys() and all(disk.group_of(key) == group for key in disk.keys())
    hit = restarted.complete(GenerationRequest(p2, prompt_cache_key="conv-1", **greedy))
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
    from exo.cards.schema import ACTIVATION_MARGIN_BYTES, CONTEXT_BUDGET_TOKENS
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
    # (one generation at a time: no batch's states to set room aside for)
    settings = load_settings(env={**env, "EXO_MEMORY_BUDGET_BYTES": str(reserve + (3 << 20)), "EXO_MAX_BATCH": "1"})
    engine = ready_engine(loaded, EngineConfig(), settings)
    assert engine.prefix_cache is not None and engine.state_room == 0
    assert engine.prefix_cache.store.ram.budget_bytes == 3 << 20
    figures = engine.prefix_cache.figures()
    assert figures["ram_budget_bytes"] == 3 << 20 and figures["disk_budget_bytes"] == settings.prefix_cache_disk_bytes
    engine.prefix_cache.store.close()
    # batching (max_batch 32): the room for its states (which the 3 MiB hold) comes before the RAM tier
    settings = load_settings(env={**env, "EXO_MEMORY_BUDGET_BYTES": str(reserve + (3 << 20))})
    engine = ready_engine(loaded, EngineConfig(), settings)
    assert engine.state_room == 32 * per_sequence <= 3 << 20
    assert engine.prefix_cache.store.ram.budget_bytes == (3 << 20) - (engine.state_room - per_sequence)
    engine.prefix_cache.store.close()


# -- prompt_cache_key groups on disk (the RAM tier's rule, MemoryStore: tests/engine/test_prefix_cache*.py) --


def _entry_bytes(tmp_path) -> int:
    probe = DiskTier(tmp_path / "probe", 1 << 30)
    probe.put("k", prepare(_entry(0)))
    return probe.bytes


def _age(tier: DiskTier, key: str, ns: int) -> None:
    os.utime(tier._path(key), ns=(ns, ns))


def _mtime(tier: DiskTier, key: str) -> int:
    return tier._path(key).stat().st_mtime_ns


def test_grouped_entries_are_evicted_together_on_disk(tmp_path):
    one = _entry_bytes(tmp_path)
    tier = DiskTier(tmp_path / "d", 4 * one)
    tier.put("ns/a", prepare(_entry(0)), "g1")
    tier.put("ns/b", prepare(_entry(1)), "g1")
    tier.put("ns/c", prepare(_entry(2)))
    tier.put("ns/d", prepare(_entry(3)))
    assert sorted(f.name for f in (tmp_path / "d").glob("*.group")) == ["ns__a.g1.group", "ns__b.g1.group"]
    tier.put("ns/e", prepare(_entry(4)))  # 5 > 4: the least recent unit is g1, which goes whole
    assert tier.keys() == ["ns/c", "ns/d", "ns/e"]
    assert tier.counts.evictions == 2 and tier.bytes == 3 * one
    assert sorted(f.name for f in (tmp_path / "d").iterdir()) == [f"ns__{k}.safetensors" for k in "cde"]


def test_a_group_alone_over_the_disk_budget_loses_its_oldest_entries(tmp_path):
    """As in RAM: the unit in use, when it is the only one, is cut from its oldest end, not dropped whole."""
    one = _entry_bytes(tmp_path)
    tier = DiskTier(tmp_path / "d", 2 * one)
    for i in range(3):
        tier.put(f"k{i}", prepare(_entry(i)), "g1")
    assert tier.keys() == ["k1", "k2"] and tier.counts.evictions == 1
    assert sorted(f.name for f in (tmp_path / "d").glob("*.group")) == ["k1.g1.group", "k2.g1.group"]

def test_a_recently_used_group_outlives_an_older_ungrouped_entry_on_disk(tmp_path):
    """A group's recency is its most recent entry's (by mtime, as every rescan reads it): its old entries stay
    while a newer ungrouped entry goes."""
    one = _entry_bytes(tmp_path)
    tier = DiskTier(tmp_path / "d", 3 * one)
    tier.rescan_s = 0.0  # the order from the directory at every write
    past = time.time_ns() - 100 * 10**9
    for i, (key, group) in enumerate([("a", "g1"), ("u", None), ("b", "g1")]):
        tier.put(key, prepare(_entry(i)), group)
        _age(tier, key, past + i * 10**9)  # a < u < b
    tier.put("c", prepare(_entry(3)))
    assert not tier.has("u") and all(tier.has(k) for k in "abc")
    assert tier.counts.evictions == 1 and tier.group_of("a") == "g1"


def test_groups_survive_a_restart_and_a_second_instance_sees_them(tmp_path):
    one = _entry_bytes(tmp_path)
    d = tmp_path / "d"
    d.mkdir()
    write_entry(d / "old.safetensors", prepare(_entry(9)))  # written before groups: an entry of its own
    other = DiskTier(d, 1 << 30)  # a second instance of the model, open all along
    other.rescan_s = 0.0
    first = DiskTier(d, 1 << 30)
    past = time.time_ns() - 100 * 10**9
    for i, (key, group) in enumerate([("x1", "g1"), ("y", None), ("x2", "g1")]):
        first.put(key, prepare(_entry(i)), group)
        _age(first, key, past + (i + 1) * 10**9)  # old < x1 < y < x2
    _age(first, "old", past)
    other.put("z", prepare(_entry(5)))  # (re-reads the directory)
    assert other.group_of("x1") == other.group_of("x2") == "g1" and other.group_of("y") is None
    restarted = DiskTier(d, 3 * one)  # 5 files > 3: old, then y go; g1 (x2 is newer than y) stays whole
    assert sorted(restarted.keys()) == ["x1", "x2", "z"] and restarted.counts.evictions == 2
    assert restarted.group_of("x1") == restarted.group_of("x2") == "g1"
    assert _equal(restarted.get("x1", "g1"), _entry(0))
    again = DiskTier(d, 3 * one)
    assert again.group_of("x1") == "g1" and again.group_of("z") is None


def test_an_ungrouped_file_from_before_groups_is_read(tmp_path):
    write_entry(tmp_path / "ns__b-1.safetensors", prepare(_entry(1)))
    tier = DiskTier(tmp_path, 1 << 30)
    assert tier.has("ns/b-1") and tier.group_of("ns/b-1") is None
    assert _equal(tier.get("ns/b-1", "g1"), _entry(1)) and tier.group_of("ns/b-1") == "g1"  # now in the user's group


def test_an_entry_used_under_another_group_moves_to_it(tmp_path):
    """A system prompt's blocks that a second conversation restores are that conversation's from then on: when
    the first conversation's group is evicted, they stay (with the group that used them last)."""
    one = _entry_bytes(tmp_path)
    d = tmp_path / "d"
    tier = DiskTier(d, 1 << 30)
    past = time.time_ns() - 100 * 10**9
    tier.put("sys", prepare(_entry(0)), "g1")
    tier.put("a", prepare(_entry(1)), "g1")
    _age(tier, "sys", past)
    _age(tier, "a", past + 10**9)
    assert _equal(tier.get("sys", "g2"), _entry(0))  # the second conversation restores the shared block
    assert tier.group_of("sys") == "g2"
    assert sorted(f.name for f in d.glob("*.group")) == ["a.g1.group", "sys.g2.group"]
    assert tier.get("sys") is not None and tier.group_of("sys") == "g2"  # a use without a group keeps it
    restarted = DiskTier(d, one)  # g1 (a) is the older unit: it goes, the shared block stays with g2
    assert restarted.keys() == ["sys"] and restarted.group_of("sys") == "g2"
    assert sorted(f.name for f in d.iterdir()) == ["sys.g2.group", "sys.safetensors"]


def test_a_corrupt_file_in_a_group_is_a_miss_and_is_removed(tmp_path):
    d = tmp_path / "d"
    tier = DiskTier(d, 1 << 30)
    tier.put("ns/a", prepare(_entry(0)), "g1")
    tier.put("ns/b", prepare(_entry(1)), "g1")
    path = tier._path("ns/a")
    path.write_bytes(path.read_bytes()[:-100])
    assert tier.get("ns/a", "g1") is None and tier.counts.corrupt == 1
    assert not path.exists() and not (d / "ns__a.g1.group").exists() and not tier.has("ns/a")
    assert tier.keys() == ["ns/b"] and _equal(tier.get("ns/b", "g1"), _entry(1))
    restarted = DiskTier(d, 1 << 30)
    assert restarted.keys() == ["ns/b"] and restarted.group_of("ns/b") == "g1"


def test_a_marker_left_without_its_entry_or_superseded_is_swept(tmp_path):
    """Markers another instance left (an entry it regrouped meanwhile, one whose entry went): the newest marker
    of an entry names its group; older ones, and those of no entry, are deleted once stale."""
    from exo.runner.prefix_store import STALE_MARKER_S

    write_entry(tmp_path / "k.safetensors", prepare(_entry(0)))
    old = time.time_ns() - int(2 * STALE_MARKER_S * 10**9)
    for name, ns in [("k.g1.group", old), ("k.g2.group", old + 10**9), ("gone.g1.group", old), ("new.g1.group", None)]:
        (tmp_path / name).touch()
        if ns is not None:
            os.utime(tmp_path / name, ns=(ns, ns))
    tier = DiskTier(tmp_path, 1 << 30)
    assert tier.keys() == ["k"] and tier.group_of("k") == "g2"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["k.g2.group", "k.safetensors", "new.g1.group"]


def test_the_tiered_store_passes_groups_to_the_disk(tmp_path):
    """Stored, restored from disk, or served from RAM: the disk's copy joins the request's group (a RAM hit
    also makes it the disk's most recent), so what RAM serves is not the first out of the disk."""
    one = pc.nbytes(_entry(0))
    store = TieredStore(4 * one, DiskTier(tmp_path, 1 << 30))
    assert store.disk is not None
    store.put("a", _entry(0), "g1")
    store.put("b", _entry(1))
    store.flush()
    assert store.disk.group_of("a") == "g1" and store.disk.group_of("b") is None
    past = time.time_ns() - 100 * 10**9
    _age(store.disk, "b", past)
    assert store.get("b", "g2") is not None and store.ram_counts.hits == 1  # from RAM
    store.flush()
    assert store.disk.group_of("b") == "g2" and _mtime(store.disk, "b") > past
    store.close()
    restarted = TieredStore(4 * one, DiskTier(tmp_path, 1 << 30))
    assert restarted.disk is not None and restarted.disk.group_of("b") == "g2"
    assert _equal(restarted.get("a", "g3"), _entry(0)) and restarted.disk.counts.hits == 1  # from disk
    assert restarted.disk.group_of("a") == "g3"
    restarted.close()


@pytest.mark.parametrize("apart", [True, False])
def test_where_device_memory_is_apart_the_disk_writer_reads_copies_of_the_ram_tier_s_entries(tmp_path, apart):
    """On CUDA a host read (the writer's numpy view) moves an array's buffer out of the GPU's memory: the RAM
    tier's entry would page back in at its next restore. There the writer gets copies (the same bytes); where
    memory is one (the CPU, Metal) it reads the entries themselves (no copy)."""
    import numpy as np

    shared: list[bool] = []

    class Watching(DiskTier):
        def put(self, key, prepared, group=None):
            ram = store.ram.get(key)
            for name, (_, a) in prepared.items():
                entry = ram[name].view(mx.uint16) if ram[name].dtype == mx.bfloat16 else ram[name]
                shared.append(np.shares_memory(np.asarray(a), np.asarray(entry)))
            return super().put(key, prepared, group)

    store = TieredStore(1 << 20, Watching(tmp_path / "disk", 1 << 30), copy_for_disk=apart)
    store.put("k0", _entry(0))
    store.flush()
    assert shared and all(s is not apart for s in shared)
    assert _equal(read_entry(store.disk._path("k0")), _entry(0))  # type: ignore[union-attr]
    store.close()
    assert TieredStore(1 << 20, None).copy_for_disk is False  # this CPU: one memory
