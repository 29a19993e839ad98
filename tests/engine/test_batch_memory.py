"""A batch's recurrent states get room of their own where the device has it (engine/batch_memory.py
``state_room``): a hybrid model's batch is then bounded by its attention KV and ``max_batch``, not by states
counted as KV tokens (issue 51: 32 clients of the 9B shape queued behind a batch of 19)."""

from __future__ import annotations

from exo.engine import Engine, EngineConfig, load_checkpoint
from exo.engine.batch_memory import batch_bytes, batch_fits, sequence_bytes, state_room


def test_states_with_room_of_their_own_leave_the_kv_budget_to_attention(checkpoint):
    engine = Engine(load_checkpoint(checkpoint("qwen3_5")), EngineConfig())
    per_token, per_sequence = sequence_bytes(engine)
    assert per_token > 0 and per_sequence > 0
    horizons = [40] * 6
    budget = (6 * 40 * per_token + per_sequence) // per_token  # the KV and one state's worth more
    assert batch_bytes(horizons, per_token, per_sequence) > budget * per_token
    assert engine.state_room == 0
    assert not batch_fits(engine, horizons, budget)  # no room set aside: every state counts as KV (as before)
    engine.state_room = 6 * per_sequence
    assert batch_fits(engine, horizons, budget)
    assert not batch_fits(engine, [40] * 7, budget)  # the attention KV of seven is over
    engine.state_room = 4 * per_sequence  # room for four: the other two states take KV budget
    assert not batch_fits(engine, horizons, budget)
    assert batch_fits(engine, horizons, budget + (2 * per_sequence) // per_token + 1)


def test_room_is_set_aside_only_where_the_node_has_it_free():
    per_sequence = 400 << 10
    assert state_room(per_sequence, 8, 8 * per_sequence) == 8 * per_sequence
    assert state_room(per_sequence, 8, 8 * per_sequence - 1) == 0
    assert state_room(per_sequence, 1, 1 << 40) == 0  # one at a time: its state is the KV budget's, as always
    assert state_room(per_sequence, 8, -5) == 0  # less free than the instance still takes
    assert state_room(0, 8, 1 << 40) == 0  # no recurrent layers: nothing to set aside


def test_a_served_engine_sets_its_room_and_reserves_it_from_the_prefix_cache(checkpoint, monkeypatch, tmp_path):
    from exo import system
    from exo.runner.loading import ready_engine, reserve_bytes
    from exo.settings import Settings

    monkeypatch.setattr(system, "memory", lambda budget=None: system.Memory(1 << 50, 1 << 45))  # (the node's, as read)
    settings = Settings(max_batch=5, home=tmp_path)
    engine = ready_engine(load_checkpoint(checkpoint("qwen3_5")), EngineConfig(), settings)
    per_token, per_sequence = sequence_bytes(engine)
    assert engine.state_room == 5 * per_sequence
    room = reserve_bytes(engine, settings)
    engine.state_room = 0
    assert room - reserve_bytes(engine, settings) == 4 * per_sequence
    # a node with little free: no room, the states count against the KV budget as before
    monkeypatch.setattr(system, "memory", lambda budget=None: system.Memory(1 << 50, reserve_bytes(engine, settings)))
    engine = ready_engine(load_checkpoint(checkpoint("qwen3_5")), EngineConfig(), settings)
    assert engine.state_room == 0


def test_a_pipeline_stage_has_room_where_its_node_has_it_and_its_prefix_cache_leaves_it(checkpoint, monkeypatch,
                                                                                         tmp_path):
    from exo import system
    from exo.engine.forward import cache_rates
    from exo.runner.loading import stage_memory, stage_prefix_cache
    from exo.settings import Settings

    loaded = load_checkpoint(checkpoint("qwen3_5"), layers=(0, 2))  # a first stage's layers
    per_token, per_sequence = cache_rates(loaded.model)
    assert per_sequence > 0
    settings = Settings(max_batch=4, home=tmp_path, kv_budget_tokens=1000, prefix_cache_ram_bytes=1 << 30)
    reserve = per_token * 1000 + per_sequence + (512 << 20)  # KV budget, one state, the activation margin
    free = {"bytes": reserve + 4 * per_sequence}
    monkeypatch.setattr(system, "memory", lambda budget=None: system.Memory(1 << 50, free["bytes"]))
    assert stage_memory(loaded, settings, batch_room=True) == (reserve + 3 * per_sequence, 4 * per_sequence)
    assert stage_memory(loaded, settings, batch_room=False) == (reserve, 0)  # (a tensor member's)
    free["bytes"] -= 1
    assert stage_memory(loaded, settings, batch_room=True) == (reserve, 0)
    assert stage_memory(loaded, settings.model_copy(update={"max_batch": 1}), batch_room=True) == (reserve, 0)
    free["bytes"] = reserve + (8 << 20)
    without = stage_prefix_cache(loaded, settings, (0, 2), reserve)
    with_room = stage_prefix_cache(loaded, settings, (0, 2), reserve + 3 * per_sequence)
    assert without.store.ram.budget_bytes - with_room.store.ram.budget_bytes == 3 * per_sequence
    without.store.close()
    with_room.store.close()
    assert stage_prefix_cache(loaded, settings, (0, 2), None) is None  # the stage's memory was not measured
    monkeypatch.setattr("exo.engine.forward.cache_rates", lambda model: 1 / 0)
    assert stage_memory(loaded, settings, batch_room=True) == (None, 0)
