"""Two real daemons on 127.0.0.1, one instance of exo-demo on each: a request goes to the instance holding its
longest cached prefix (an agent's next turn to the instance that served the one before, through either
node's API, at once or later), one whose prefix no instance holds to its ``prompt_cache_key``'s instance, and otherwise as
before (the least loaded, then the node's own)."""

from __future__ import annotations

import pytest

from .daemons import Daemon, start_all, wait_for

MODEL = "exo-demo"
pytestmark = pytest.mark.timeout(420)
ENV = {"EXO_PREFIX_CACHE_BLOCK_TOKENS": "16", "EXO_PREFIX_CACHE_DISK_BYTES": "0"}


def _system(topic: str) -> str:
    return f"You are a coding agent working on {topic}. Tools: read(path), grep(pattern), run(cmd). " * 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    daemons = [Daemon(root / n, n, env=ENV) for n in ("node-a", "node-b")]
    start_all(daemons, [d.address for d in daemons])
    try:
        a, b = daemons
        ids = {a.node_id, b.node_id}
        for d in daemons:
            wait_for(lambda d=d: d.node_ids() == ids, 20, f"{d.name} to see both nodes")
        first = a.post("/v1/instances", {"model": MODEL, "node": a.node_id, "wait": True})
        assert first.status_code == 201, first.text
        # A model has one instance unless a replica is asked for.
        refused = b.post("/v1/instances", {"model": MODEL, "node": b.node_id})
        assert refused.status_code == 409, refused.text
        second = b.post("/v1/instances", {"model": MODEL, "node": b.node_id, "wait": True, "replica": True})
        assert second.status_code == 201, second.text
        ia, ib = first.json()["instance"]["id"], second.json()["instance"]["id"]
        for d in daemons:
            wait_for(lambda d=d: {i["id"] for i in d.get("/v1/instances").json()["instances"]
                                  if i["state"] == "ready" and i["model"] == MODEL} == {ia, ib}, 60,
                     f"{d.name} to see both instances ready")
        yield a, b, ia, ib
    finally:
        for d in daemons:
            d.stop()


def _view(d: Daemon, instance_id: str) -> dict:
    return d.get(f"/v1/instances/{instance_id}").json()


def _lookups(d: Daemon, instance_id: str) -> int:
    return (_view(d, instance_id)["prefix_cache"] or {}).get("lookups", 0)


def _settled(daemons, instances, lookups: dict[str, int]) -> None:
    """Every node sees every instance with ``lookups`` and idle (what the routers read)."""
    for d in daemons:
        for i in instances:
            wait_for(lambda d=d, i=i: _lookups(d, i) == lookups[i] and _view(d, i)["running"] == 0, 20,
                     f"{d.name} to see {i} with {lookups[i]} lookups")


def _chat(d: Daemon, messages, **extra) -> dict:
    response = d.post("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 6,
                                               "temperature": 0, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def test_the_next_turn_goes_where_its_prefix_is_and_a_key_keeps_its_instance(pair):
    a, b, ia, ib = pair
    count = {ia: 0, ib: 0}
    turn1 = [{"role": "system", "content": _system("the parser")}, {"role": "user", "content": "Find the bug"}]
    first = _chat(a, turn1)  # no instance holds anything: the node's own (both idle)
    count[ia] += 1
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    _settled(pair[:2], (ia, ib), count)
    wait_for(lambda: _view(b, ia)["prefix_cache"]["held_prefixes"] > 0, 20, "B to see what A's instance holds")

    # The next turn, through B's API: B's own instance is idle too, but A's holds the conversation.
    turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Tool result: line 12 divides by zero"}]
    second = _chat(b, turn2)
    count[ia] += 1
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    _settled(pair[:2], (ia, ib), count)

    # Another conversation through B: nobody holds it, so B's own instance serves it.
    other = [{"role": "system", "content": _system("the scheduler")}, {"role": "user", "content": "Add a test"}]
    assert _chat(b, other)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    count[ib] += 1
    _settled(pair[:2], (ia, ib), count)

    # prompt_cache_key: the key's first request lands on B's instance (through B) ...
    keyed = [{"role": "system", "content": _system("the linker")}, {"role": "user", "content": "Why slow?"}]
    _chat(b, keyed, prompt_cache_key="session-7")
    count[ib] += 1
    _settled(pair[:2], (ia, ib), count)
    wait_for(lambda: _view(a, ib)["prefix_cache"]["held_prefixes"] >= 2, 20, "A to see B's new entries")
    # ... and its next request, whose prefix nobody holds (another system prompt), follows it through A.
    moved = [{"role": "system", "content": _system("the allocator")}, {"role": "user", "content": "Why slow?"}]
    reply = _chat(a, moved, prompt_cache_key="session-7")
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    count[ib] += 1
    # Its next turn at once, without the key, through A: before B's summary reaches A (~2.5 s), A's router
    # remembers what it sent B's instance.
    follow = moved + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "Tool result: 3 allocations per call"}]
    assert _chat(a, follow)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    count[ib] += 1
    _settled(pair[:2], (ia, ib), count)
    # Without the key the same kind of request stays on A's own instance.
    fresh = [{"role": "system", "content": _system("the cache")}, {"role": "user", "content": "Why slow?"}]
    _chat(a, fresh)
    count[ia] += 1
    _settled(pair[:2], (ia, ib), count)
