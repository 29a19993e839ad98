"""Which instance of a model serves a request, where the model has several (docs/prefix-cache.md).

The one holding the request's longest cached prefix: an agent's next turn goes where its previous turn's
caches are. Each runner's status carries a compact summary of its prefix cache (``PrefixSummary``: its
namespace and block size, the positions and 64-bit hashes of its most recently used snapshots, and the
hashes of the ``prompt_cache_key``s it served last); every node sees its peers' instances with theirs. The
router tokenizes the prompt as the runner will (the model's tokenizer, on this node's disk), hashes its
blocks the way the cache does and checks each listed position against the prompt's own key there
(``held_prefix``): a few microseconds of hashing per candidate besides the tokenization, no call to any
node, nothing on the request's path when the model has one instance.

Then, when no instance holds a prefix (or several hold the same): the one that served the request's
``prompt_cache_key`` last (same key, same instance: its later requests find the key's entries together),
then the least loaded (queued + running, as its node last said, or as this node's own streams to it say
if more), then this node's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from exo.engine.prefix_cache import Summary, held_prefix, key_hash
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


def choose(candidates: Sequence[Candidate], tokens: Sequence[int] | None, cache_key: str | None) -> Choice:
    """The instance to send a request to (``tokens``: the prompt's, None when they cannot be known here)."""
    assert candidates
    chains: dict[tuple[str, int], list[bytes]] = {}
    wanted = key_hash(cache_key) if cache_key else None
    scored = []
    for i, c in enumerate(candidates):
        inst = c.located.instance
        held = 0
        if tokens is not None and inst.HasField("prefix_summary") and inst.prefix_summary.block_tokens > 0:
            held = held_prefix(tokens, summary_from_pb(inst.prefix_summary), chains)
        keyed = wanted is not None and wanted in inst.prefix_summary.keys
        scored.append(((-held, not keyed, c.load, not c.ours, i), held, keyed, c))
    _, held, keyed, best = min(scored, key=lambda s: s[0])
    return Choice(best.located, held, keyed)
