"""Which instance of a model serves a request, where the model has several (docs/prefix-cache.md).

The one holding the request's longest cached prefix: an agent's next turn goes where its previous turn's
caches are. Each runner's status carries a compact summary of its prefix cache (``PrefixSummary``: its
namespace and block size, the positions and 64-bit hashes of its most recently used snapshots, and the
hashes of the ``prompt_cache_key``s it served last); every node sees its peers' instances with theirs. The
router tokenizes the prompt as the runner will (the model's tokenizer, on this node's disk), hashes its
blocks the way the cache does and checks each listed position against the prompt's own key there
(``held_prefix``): a few microseconds of hashing per candidate besides the tokenization, no call to any
node, nothing on the request's path when the model has one instance.

A summary reaches the other nodes within ~2.5 s (the runner's status every second, the peers' every 1.5 s),
and an agent sends its next turn as soon as its tool returns: so the router also remembers, for a while,
what it sent where (``Recent``: the snapshots the request's prefill will store, as the cache picks them,
and its key), and reads those as if the instance's summary listed them.

Then, when no instance holds a prefix (or several hold the same): the one that served the request's
``prompt_cache_key`` last (same key, same instance: its later requests find the key's entries together),
then the least loaded (queued + running, as its node last said, or as this node's own streams to it say
if more), then this node's own.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from exo.engine.prefix_cache import (
    MIN_SNAPSHOT_TOKENS,
    SUMMARY_HEADS,
    Summary,
    block_chain,
    head_hash,
    held_prefix,
    key_hash,
    snapshot_edges,
    snapshot_key,
)
from exo.wire.proto_gen import node_pb2 as pb

from .views import Located


@dataclass(frozen=True)
class Candidate:
    located: Located
    load: int  # queued + running
    ours: bool  # on this node


@dataclass(frozen=True)
class Choice:
    located: Located
    held_tokens: int  # the prompt's prefix the chosen instance holds (as its summary says)
    by_key: bool  # it served the request's prompt_cache_key


def summary_from_pb(msg: pb.PrefixSummary) -> Summary:
    return Summary(msg.namespace, msg.block_tokens, tuple(zip(msg.positions, msg.hashes, strict=False)), tuple(msg.keys))


RECENT_S = 30.0  # how long the router reads its own decisions as held (summaries have long caught up by then)


class Recent:
    """What this router sent to each instance lately: the snapshots those requests' prefills store and their
    keys, until the instances' own summaries say so (``RECENT_S``). Thread-safe (routes run in workers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_instance: dict[str, OrderedDict[tuple[int, int] | int, float]] = {}

    def add(self, instance_id: str, heads: Sequence[tuple[int, int]], key: int | None) -> None:
        now = time.monotonic()
        with self._lock:
            entries = self._by_instance.setdefault(instance_id, OrderedDict())
            for item in [*heads, *([key] if key is not None else [])]:
                entries[item] = now
                entries.move_to_end(item)
            while len(entries) > SUMMARY_HEADS:
                entries.popitem(last=False)

    def summary(self, instance_id: str, reported: Summary) -> Summary:
        """``reported`` with what this router sent the instance since (a summary under its namespace)."""
        limit = time.monotonic() - RECENT_S
        with self._lock:
            entries = self._by_instance.get(instance_id)
            if not entries:
                return reported
            for item in [item for item, at in entries.items() if at < limit]:
                del entries[item]
            heads = [item for item in entries if isinstance(item, tuple)]
            keys = [item for item in entries if isinstance(item, int)]
        return Summary(reported.namespace, reported.block_tokens, (*reported.heads, *heads), (*reported.keys, *keys))

    def forget(self, instance_id: str) -> None:
        with self._lock:
            self._by_instance.pop(instance_id, None)


def stored_heads(tokens: Sequence[int], summary: Summary, message_starts: frozenset[int], stride: int) -> list[tuple[int, int]]:
    """The snapshots a prefill of ``tokens`` stores in a cache like ``summary``'s (``snapshot_edges``), as a
    summary lists them."""
    if summary.block_tokens <= 0:
        return []
    edges = snapshot_edges(tokens, message_starts, stride, MIN_SNAPSHOT_TOKENS)
    if not edges:
        return []
    chain = block_chain(tokens[: edges[-1]], summary.block_tokens, summary.namespace)
    return [(p, head_hash(snapshot_key(p, chain, tokens, summary.block_tokens))) for p in edges]


def choose(candidates: Sequence[Candidate], tokens: Sequence[int] | None, prompt_cache_key: str | None,
           recent: Recent | None = None) -> Choice:
    """The instance to send a request to (``tokens``: the prompt's, None when they cannot be known here;
    ``recent``: this router's own recent decisions)."""
    assert candidates
    chains: dict[tuple[str, int], list[bytes]] = {}
    wanted = key_hash(prompt_cache_key) if prompt_cache_key else None
    scored = []
    for i, c in enumerate(candidates):
        inst = c.located.instance
        summary = summary_from_pb(inst.prefix_summary)
        if recent is not None:
            summary = recent.summary(inst.instance_id, summary)
        held = 0
        if tokens is not None and summary.block_tokens > 0:
            held = held_prefix(tokens, summary, chains)
        keyed = wanted is not None and wanted in summary.keys
        scored.append(((-held, not keyed, c.load, not c.ours, i), held, keyed, c))
    _, held, keyed, best = min(scored, key=lambda s: s[0])
    return Choice(best.located, held, keyed)
