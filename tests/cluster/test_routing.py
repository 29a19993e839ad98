"""The router's choice among a model's instances (cluster/routing.py): the longest held prefix, then the
prompt_cache_key's instance, then the least loaded, then this node's own."""

from __future__ import annotations

from exo.cluster.routing import Candidate, choose
from exo.cluster.views import Located
from exo.engine import prefix_cache as pc
from exo.wire.proto_gen import node_pb2 as pb

BLOCK = 4
TOKENS = list(range(100, 140))


def _candidate(name: str, *, held: tuple[int, ...] = (), keys: tuple[str, ...] = (), load: int = 0, ours: bool = False,
               tokens: list[int] = TOKENS, ns: str = "ns") -> Candidate:
    chain = pc.block_chain(tokens, BLOCK, ns)
    summary = pb.PrefixSummary(namespace=ns, block_tokens=BLOCK, positions=list(held),
                               hashes=[pc.head_hash(pc.snapshot_key(p, chain, tokens, BLOCK)) for p in held],
                               keys=[pc.key_hash(k) for k in keys])
    inst = pb.Instance(instance_id=name, prefix_summary=summary)
    return Candidate(Located(f"node-{name}", inst), load, ours)


def _pick(candidates, tokens=TOKENS, key=None) -> str:
    return choose(candidates, tokens, key).located.instance.instance_id


def test_the_longest_held_prefix_wins_over_load_key_and_locality():
    far = _candidate("far", held=(9, 21), load=3)
    near = _candidate("near", held=(9,), keys=("k",), ours=True)
    assert _pick([near, far], key="k") == "far"
    choice = choose([near, far], TOKENS, "k")
    assert choice.held_tokens == 21 and not choice.by_key
    # What it holds of another prompt (diverging at token 12) does not count past the divergence.
    other = TOKENS[:12] + [7] + TOKENS[13:]
    assert choose([near, far], other, None).held_tokens == 9
    # A position at or past the prompt's end cannot be restored (the last token is always fed).
    assert choose([_candidate("x", held=(40,))], TOKENS, None).held_tokens == 0


def test_without_a_held_prefix_the_key_then_the_load_then_our_own():
    a, b = _candidate("a", ours=True), _candidate("b", keys=("session",), load=1)
    assert _pick([a, b], key="session") == "b"
    assert _pick([a, b], key="other") == "a"
    assert _pick([_candidate("a", load=2, ours=True), _candidate("b", load=1)]) == "b"
    assert _pick([_candidate("a"), _candidate("b", ours=True)]) == "b"
    # No tokens (the tokenizer is not on this node): the key and the load still decide.
    assert _pick([_candidate("a", held=(9,), ours=True), b], tokens=None, key="session") == "b"
    # A summary of another namespace (another checkpoint) matches nothing.
    assert choose([_candidate("a", held=(9, 21), ns="other")], TOKENS, None).held_tokens == 21
    foreign = _candidate("a", held=(9, 21), ns="other")
    foreign.located.instance.prefix_summary.namespace = "ns"
    assert choose([foreign], TOKENS, None).held_tokens == 0


def test_the_router_reads_its_own_recent_decisions_as_held(monkeypatch):
    from exo.cluster import routing

    chat = [1] + [7] * 99 + [1] + list(range(200, 289)) + [1] + [9] * 5  # messages start at 0, 100 and 190
    reported = _candidate("b").located.instance.prefix_summary
    heads = routing.stored_heads(chat, routing.summary_from_pb(reported), frozenset({1}), 0)
    assert [p for p, _ in heads] == [100, 190]  # the system part's end, the generation header
    recent = routing.Recent()
    a, b = _candidate("a", ours=True), _candidate("b")
    assert _pick([a, b], tokens=chat) == "a"
    recent.add("b", heads, pc.key_hash("k"))
    nxt = chat[:190] + [1] + [3] * 40 + [1] + [9] * 5  # the next turn
    choice = choose([a, b], nxt, None, recent)
    assert choice.located.instance.instance_id == "b" and choice.held_tokens == 190
    assert _pick([a, b], tokens=[1] + [4] * 120, key="k") == "a"  # (no recent: nothing says b has the key)
    assert choose([a, b], [1] + [4] * 120, "k", recent).located.instance.instance_id == "b"  # by key
    monkeypatch.setattr(routing.time, "monotonic", lambda: 1e12)  # long after: the summaries have caught up
    assert choose([a, b], nxt, None, recent).located.instance.instance_id == "a"
