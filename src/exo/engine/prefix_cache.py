"""A prefix cache for hybrid models: a request whose prompt starts like an earlier one's restores that
prefix's caches instead of prefilling it again (an agent resends its whole conversation every turn).

What is kept, per model and stage (``namespace``) in a ``PrefixStore`` (a key -> dict of arrays store;
``MemoryStore`` here, RAM + disk tiers in ``exo.runner.prefix_store``):

- ``b-<chain>``: attention KV of one block of ``block_tokens`` prompt tokens, every attention layer of the
  stage. ``chain`` is a hash chain over the blocks (``block_chain``), so a block is shared by every prompt
  that starts with the same tokens up to its end.
- ``h-<chain>``: the MTP head's cache entries of the same block, shifted by one: head entry q consumes
  (hidden[q], token[q + 1]), so it belongs to the block holding q + 1 (a block's entries are a function
  of the tokens up to its end).
- ``s-<p>-<hash>``: a snapshot at prompt position p (the state after tokens [0, p)): every GatedDeltaNet
  layer's conv window and recurrent state (a recurrent state cannot be cut at an arbitrary token, so only
  positions where one was taken can be restored) and the KV of the tokens after the last full block.
- ``sh-<p>-<hash>``: the head's entries after the last full block, up to p - 1, and the post-norm hidden of
  position p - 1 (the head pairs it with token p). Kept here, not in the snapshot: only a run that feeds the
  head computes a chunk's last hidden at all (otherwise the last layer's output of a chunk that is not the
  prompt's last is never evaluated, and evaluating it for a snapshot cost seconds a turn on this CPU).

Snapshots are taken at ``snapshot_edges`` (inside a prefill chunk, without cutting it: its GatedDeltaNet layers
keep their states there, ``PrefillPlan.arm``): the start of
the last message, i.e. the generation header (where the next turn continues: it resends everything before
it), the start of the second message (the end of the system + tools part, where conversations diverge),
the end of a prompt that is not a chat, and every ``stride_tokens``.
A restore goes to the deepest snapshot whose blocks are all held, with the head's parts too when the
run drafts; the run then prefills only the rest. Captured after the prefill, from the prompt's positions;
and when a sequence ends normally (``capture_end``: finish stop or length, a reply of a block or more), its
reply's blocks and a snapshot at its end, the positions its caches hold of prompt + output (never an
accepted-but-unemitted position past a finish): an agent's next turn resends the reply.

The hook: ``Engine.start`` ends with ``restore_prefix``, which looks the prompt up (``PrefixCache.plan``)
and hands the restored caches to the new sequence through its seam (``SequenceState.restore``), so a solo
run, a batch newcomer and constrained or logprobs runs all get it; the sequence keeps the plan
(``PrefillPlan``) for its prefill's chunks and snapshot edges (``spans``, ``arm``, ``reached``) and calls ``capture`` once its
first token is out; ``store_reply`` calls ``capture_end`` where a sequence ends (a member leaving the one decode
loop, ``BatchDecoder._store_ended``: a lone member's own caches, a batched one's row); on a pipeline the other
stages store their part of it too (``StagePrefix.store_end``, the leader's STORE_END op record).

A store that raises (out of memory or disk, an unreadable entry) is a miss or a skipped store, logged and counted
(``PrefixCache.note_failure``), never a failed request or a stage that stops: a restore touches no cache before it has
read everything, and a sequence whose store failed stores nothing more.
"""

from __future__ import annotations

import array
import functools
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .models.layers import RollbackArraysCache

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: the hidden of p - 1 moved from the snapshot to the head's tail
BLOCK_TOKENS = 256
STRIDE_TOKENS = 8192
MIN_SNAPSHOT_TOKENS = 64  # a snapshot of a shorter prefix costs more than the prefill it saves
# A store's disk writer waits this long from each prefill chunk's start (``PrefillPlan.arm``): a lease longer than a
# GPU's chunk (0.1-0.25 s on an H200), so it holds through a prompt's chunks and ends by itself after them.
QUIET_S = 1.0
# Chat templates' message-start tokens: a snapshot at the second one is the end of the system + tools part,
# at the last one the start of the newest message (what the next turn resends unchanged).
MESSAGE_START_TOKENS = ("<|im_start|>",)
# A prompt ending at most this many tokens after its last message start ends in a generation header: its last
# snapshot is the header's start (one snapshot a turn, not two; the next turn prefills the header again).
HEADER_TOKENS = 16
# A summary lists this many of the most recently used snapshots (16 bytes each on the wire) and keys (8 each).
SUMMARY_HEADS = 256
SUMMARY_KEYS = 64

Arrays = dict[str, mx.array]


class PrefixStore(Protocol):
    """Where a prefix cache keeps its entries (arrays already evaluated); ``group``: the request's
    ``prompt_cache_key`` group, whose entries the store keeps and evicts together (``MemoryStore``)."""

    def get(self, key: str, group: str | None = None) -> Arrays | None: ...

    def put(self, key: str, arrays: Arrays, group: str | None = None) -> Any: ...

    def has(self, key: str) -> bool: ...

    def keys(self) -> Iterable[str]: ...


def nbytes(arrays: Arrays) -> int:
    return sum(a.nbytes for a in arrays.values())


class GroupedOrder:
    """Keys and their sizes in least-recently-used order, by unit: the keys used with a ``group`` (a hash of
    a request's ``prompt_cache_key``) are one unit, whose recency is its last use, and a key used without
    one is a unit of its own. Both tiers keep their entries in one (``MemoryStore``, and the disk tier's
    ``exo.runner.prefix_store.DiskTier``); their owner holds the lock."""

    def __init__(self) -> None:
        self.sizes: dict[str, int] = {}
        # unit -> its keys (least recent first), units least recent first; a unit is ("g", group) or ("k", key)
        self._units: OrderedDict[tuple[str, str], OrderedDict[str, None]] = OrderedDict()
        self._unit_of: dict[str, tuple[str, str]] = {}
        self.bytes = 0

    def __contains__(self, key: str) -> bool:
        return key in self._unit_of

    def __len__(self) -> int:
        return len(self._unit_of)

    def keys(self) -> list[str]:
        return [key for members in self._units.values() for key in members]

    def group(self, key: str) -> str | None:
        unit = self._unit_of.get(key)
        return unit[1] if unit is not None and unit[0] == "g" else None

    def use(self, key: str, size: int, group: str | None) -> None:
        """``key`` (``size`` bytes) is the most recently used, in ``group``'s unit (None: a unit of its own)."""
        unit = ("g", group) if group else ("k", key)
        old = self._unit_of.get(key)
        if old is not None and old != unit:
            self._leave(key, old)
        members = self._units.get(unit)
        if members is None:
            members = self._units[unit] = OrderedDict()
        members[key] = None
        members.move_to_end(key)
        self._units.move_to_end(unit)
        self._unit_of[key] = unit
        self.bytes += size - self.sizes.get(key, 0)
        self.sizes[key] = size

    def forget(self, key: str) -> str | None:
        """``key`` out of the order (no error if absent); returns the group it was in."""
        unit = self._unit_of.pop(key, None)
        if unit is None:
            return None
        self._leave(key, unit)
        self.bytes -= self.sizes.pop(key)
        return unit[1] if unit[0] == "g" else None

    def _leave(self, key: str, unit: tuple[str, str]) -> None:
        members = self._units[unit]
        members.pop(key, None)
        if not members:
            del self._units[unit]

    def victims(self) -> tuple[str | None, list[str]]:
        """What to evict next and its group: the least recent unit whole, or, where it is the only one left (the
        one in use), its oldest key."""
        unit, members = next(iter(self._units.items()))
        return (unit[1] if unit[0] == "g" else None), list(members) if len(self._units) > 1 else [next(iter(members))]


class MemoryStore:
    """Entries in memory, least recently used out first once ``budget_bytes`` is exceeded.

    Entries stored or read with a ``group`` (a hash of the request's ``prompt_cache_key``) are kept and
    dropped together: the group is one unit of the LRU order (its recency: its last use), and evicting it
    drops all its entries (a conversation's blocks and snapshots are worth little apart: a snapshot
    restores only with every block before it). An entry belongs to the group that used it last; entries
    used without a group are units of their own (plain LRU); ``GroupedOrder`` keeps the order."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._entries: dict[str, Arrays] = {}
        self._order = GroupedOrder()
        self.evictions = 0
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        return self._order.bytes

    def get(self, key: str, group: str | None = None) -> Arrays | None:
        with self._lock:
            arrays = self._entries.get(key)
            if arrays is not None:  # (read without a group: it stays in its own)
                self._order.use(key, self._order.sizes[key], group or self._order.group(key))
            return arrays

    def has(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        with self._lock:
            return self._order.keys()

    def group_of(self, key: str) -> str | None:
        """The group ``key`` belongs to (None: none, or not held)."""
        with self._lock:
            return self._order.group(key)

    def put(self, key: str, arrays: Arrays, group: str | None = None) -> list[str]:
        """Returns the keys evicted to make room."""
        size = nbytes(arrays)
        evicted: list[str] = []
        with self._lock:
            if size > self.budget_bytes:
                self._drop(key)
                return evicted
            self._entries[key] = arrays
            self._order.use(key, size, group)  # (stored without a group: an entry of its own)
            while self._order.bytes > self.budget_bytes:
                for old in self._order.victims()[1]:
                    self._drop(old)
                    self.evictions += 1
                    evicted.append(old)
        return evicted

    def _drop(self, key: str) -> None:
        self._entries.pop(key, None)
        self._order.forget(key)

    def remove(self, key: str) -> None:
        with self._lock:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._entries)


# -- keys ---------------------------------------------------------------------------------------------


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def _token_bytes(tokens: Sequence[int]) -> bytes:
    return array.array("I", tokens).tobytes()


def namespace(loaded: Any, layers: tuple[int, int] | None = None) -> str:
    """What a cached state depends on besides the tokens: the checkpoint (its id, config, the weight files'
    names, sizes and times), the stage's layer range, a tensor group member's slice and this module's format."""
    path = Path(loaded.path)
    files = []
    for f in sorted(path.glob("*.safetensors")):
        stat = f.stat()
        files.append((f.name, stat.st_size, stat.st_mtime_ns))
    fields = {"model": loaded.model_id, "config": loaded.config, "files": files, "layers": list(layers or ()),
              "format": FORMAT_VERSION}
    share = getattr(getattr(loaded, "model", None), "tensor_share", None)
    if share is not None:  # each member holds its own heads' and columns' part
        fields["tensor"] = [share.rank, share.size]
    identity = json.dumps(fields, sort_keys=True, default=str)
    return _digest(identity.encode()).hex()


def block_chain(tokens: Sequence[int], block: int, ns: str) -> list[bytes]:
    """chain[b]: the hash of ``tokens[: b * block]`` (chain[0] the namespace's root), for every full block."""
    chain = [_digest(ns.encode())]
    for b in range(len(tokens) // block):
        chain.append(_digest(chain[-1], _token_bytes(tokens[b * block : (b + 1) * block])))
    return chain


def snapshot_key(p: int, chain: list[bytes], tokens: Sequence[int], block: int) -> str:
    m = p // block
    return f"s-{p}-{_digest(chain[m], _token_bytes(tokens[m * block : p])).hex()}"


def head_hash(name: str) -> int:
    """A snapshot key's hash as a summary carries it (its first 64 bits)."""
    return int(name.rsplit("-", 1)[1][:16], 16)


def key_hash(prompt_cache_key: str) -> int:
    """A ``prompt_cache_key`` as a summary and a store's groups carry it (64 bits of its hash)."""
    return int.from_bytes(_digest(b"prompt_cache_key", prompt_cache_key.encode("utf-8", "surrogatepass"))[:8], "big")


@dataclass(frozen=True)
class Summary:
    """What a prefix cache holds, compactly (a runner's status carries it to every router of the cluster):
    its namespace and block size, the most recently used snapshots as (position, 64 bits of the key's hash),
    and the most recent ``prompt_cache_key`` hashes it served."""

    namespace: str
    block_tokens: int
    heads: tuple[tuple[int, int], ...] = ()
    keys: tuple[int, ...] = ()


def held_prefix(tokens: Sequence[int], summary: Summary, chains: dict[tuple[str, int], list[bytes]] | None = None) -> int:
    """The longest prefix of ``tokens`` that ``summary`` lists a snapshot of (0: none): the prompt's blocks
    hashed the way the cache hashes them, then every listed position checked against the prompt's key there.
    ``chains``: hash chains already computed for other summaries (per namespace and block size)."""
    n = len(tokens)
    heads = [(p, h) for p, h in summary.heads if 0 < p < n]
    if not heads:
        return 0
    memo = chains if chains is not None else {}
    chain = memo.get((summary.namespace, summary.block_tokens))
    if chain is None:
        chain = memo[(summary.namespace, summary.block_tokens)] = block_chain(tokens, summary.block_tokens, summary.namespace)
    best = 0
    for p, h in sorted(heads, reverse=True):
        if p <= best:
            break
        if head_hash(snapshot_key(p, chain, tokens, summary.block_tokens)) == h:
            best = p
    return best


def message_starts(tokenizer: Any) -> frozenset[int]:
    """Token ids that start a chat message in this tokenizer (none: only the end and the stride)."""
    ids = set()
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    for text in MESSAGE_START_TOKENS:
        if text in vocab:
            ids.add(int(vocab[text]))
    return frozenset(ids)


def snapshot_edges(tokens: Sequence[int], starts: frozenset[int], stride: int, minimum: int) -> list[int]:
    """Positions to snapshot a prompt at: the second message start (the end of the system + tools part), the
    last one (the assistant header the next turn renders again, perhaps without what a template adds to a
    generation prompt, such as an opened think block), the end when more than a header follows the last
    start (a raw completion), and every ``stride``."""
    n = len(tokens)
    edges = set()
    found = [i for i, t in enumerate(tokens) if t in starts] if starts else []
    if len(found) >= 2:
        edges.add(found[1])
    if found:
        edges.add(found[-1])
    if not found or n - found[-1] > HEADER_TOKENS:
        edges.add(n - 1)  # (the last token is always fed: this serves the same prompt again and its extensions)
    if stride > 0:
        edges.update(range(stride, n, stride))
    return sorted(p for p in edges if minimum <= p < n)


# -- the cache ----------------------------------------------------------------------------------------


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    captured_bytes: int = 0
    failures: int = 0  # store / read / lookup calls that raised: each a miss or a skipped store (``failed``)


class PrefixCache:
    """One model stage's prefix cache over a store (see the module's docstring)."""

    def __init__(self, store: PrefixStore, ns: str, *, block_tokens: int = BLOCK_TOKENS,
                 stride_tokens: int = STRIDE_TOKENS, message_starts: frozenset[int] = frozenset(),
                 min_snapshot_tokens: int = MIN_SNAPSHOT_TOKENS) -> None:
        self.store = store
        self.ns = ns
        self.block = block_tokens
        self.stride = stride_tokens
        self.starts = message_starts
        self.min_snapshot = min_snapshot_tokens
        self.stats = PrefixStats()
        # Snapshot positions held (or once held): the candidates a prompt's lookup hashes.
        self._lengths: set[int] = set()
        # The summary's parts (most recent last): snapshot names -> their positions; prompt_cache_key hashes.
        self._recent: OrderedDict[str, int] = OrderedDict()
        self._recent_keys: OrderedDict[int, None] = OrderedDict()
        self._summary_lock = threading.Lock()
        try:
            held = store.keys()
        except Exception as e:  # noqa: BLE001 - an unreadable store starts empty, as a cache may
            self.note_failure("listing what the store holds", e)
            held = []
        for key in held:
            if key.startswith(f"{ns}/s-"):
                try:
                    p = int(key.split("-", 2)[1])
                except ValueError:  # not a snapshot this cache wrote (a stray file): never restored
                    continue
                self._lengths.add(p)
                self._note(key[len(ns) + 1 :], p)

    def _note(self, name: str, p: int) -> None:
        with self._summary_lock:
            self._recent[name] = p
            self._recent.move_to_end(name)
            while len(self._recent) > SUMMARY_HEADS:
                self._recent.popitem(last=False)

    def note_key(self, prompt_cache_key: str | None) -> str | None:
        """A request's ``prompt_cache_key``: kept for the summary; returns its store group (None: none)."""
        if not prompt_cache_key:
            return None
        h = key_hash(prompt_cache_key)
        with self._summary_lock:
            self._recent_keys[h] = None
            self._recent_keys.move_to_end(h)
            while len(self._recent_keys) > SUMMARY_KEYS:
                self._recent_keys.popitem(last=False)
        return f"{h:016x}"

    def summary(self) -> Summary:
        """What this cache holds, for routers (``Summary``); snapshots evicted since are left out. Safe from
        another thread than the one generating. A store that raises lists none (the runner's status carries
        this every second: it must not fail; the requests' own lookups log and count the store's failures)."""
        with self._summary_lock:
            recent = list(self._recent.items())
            keys = tuple(self._recent_keys)
        try:
            heads = tuple((p, head_hash(name)) for name, p in recent if self.store.has(self.key(name)))
        except Exception as e:  # noqa: BLE001 - a summary is a routing hint
            log.debug("prefix cache: no summary (%s: %s)", type(e).__name__, e)
            heads = ()
        return Summary(self.ns, self.block, heads, keys)

    def figures(self) -> dict[str, int]:
        """Counters of this cache and its store's figures (bytes and counters per tier)."""
        s = self.stats
        out = {"lookups": s.lookups, "hits": s.hits, "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
               "failures": s.failures}
        store_figures = getattr(self.store, "figures", None)
        if store_figures is not None:
            out.update(store_figures())
        elif isinstance(self.store, MemoryStore):
            out.update(ram_bytes=self.store.bytes, ram_entries=len(self.store), ram_evictions=self.store.evictions)
        return out

    def key(self, name: str) -> str:
        return f"{self.ns}/{name}"

    def note_failure(self, what: str, error: BaseException) -> None:
        """A call on the store (or on what it returned) raised: the store may be out of memory or disk, or a
        tier broken; the cache is only ever a shortcut, so the caller takes a miss (or skips the store) and the
        request goes on exactly as a cold one. Counted (``figures``: ``failures``) and logged once a call."""
        self.stats.failures += 1
        log.warning("prefix cache: %s failed, the request goes on without it (%s: %s)", what,
                    type(error).__name__, error, exc_info=error)

    def _held(self, tokens: Sequence[int], chain: list[bytes], need_head: bool,
              deepest: bool = False) -> list[tuple[int, str]]:
        """``held`` as a list (``deepest``: the first only); a store that raises holds nothing."""
        try:
            if deepest:
                found = next(self.held(tokens, chain, need_head), None)
                return [] if found is None else [found]
            return list(self.held(tokens, chain, need_head))
        except Exception as e:  # noqa: BLE001 - a cache that cannot be read is a miss
            self.note_failure("a lookup", e)
            return []

    def held(self, tokens: Sequence[int], chain: list[bytes], need_head: bool) -> Iterator[tuple[int, str]]:
        """The snapshots of ``tokens`` this cache holds with every block before them (and, ``need_head``,
        the MTP head's parts), deepest first, as (position, snapshot name). At least the last prompt token is
        fed (SequenceState.restore): a snapshot at a prompt's end serves the prompts that extend it."""
        for p in sorted((p for p in self._lengths if p < len(tokens)), reverse=True):
            name = snapshot_key(p, chain, tokens, self.block)
            if not self.store.has(self.key(name)):
                continue
            m = p // self.block
            needed = [self.key(f"b-{chain[b].hex()}") for b in range(1, m + 1)]
            if need_head:
                needed += [self.key(f"h-{chain[b].hex()}") for b in range(1, m + 1)]
                needed.append(self.key("sh" + name[1:]))
            if all(self.store.has(k) for k in needed):
                yield p, name

    def plan(self, tokens: Sequence[int], need_head: bool, prompt_cache_key: str | None = None, *,
             within: Callable[[list[int]], int] | None = None, edges: list[int] | None = None) -> PrefillPlan:
        """The restore point and snapshot edges for a prompt (with its ``prompt_cache_key``).
        A pipeline's stages: ``within`` settles on a position among those this stage holds (the leader asks the
        other stages, 0: none), ``edges`` are the leader's (a stage has no tokenizer to find message starts)."""
        group = self.note_key(prompt_cache_key)
        tokens = list(tokens)
        chain = block_chain(tokens, self.block, self.ns)
        self.stats.lookups += 1
        self.stats.prompt_tokens += len(tokens)
        found = None
        head = need_head
        if within is None:
            found = next(iter(self._held(tokens, chain, need_head, deepest=True)), None)
            if need_head and found is not None:
                # A reply's end is stored without the head's parts where the head skipped rows (an adaptive run's
                # plain stretches): restoring it without them (the head starts with a gap: drafts land less at
                # first, the output is the same) beats prefilling the reply again when it is a block or more past
                # the deepest snapshot held with them. (None held with them: prefill, the head gets it all.)
                bare = next(iter(self._held(tokens, chain, False, deepest=True)), None)
                if bare is not None and bare[0] - found[0] >= self.block:
                    found, head = bare, False
        else:
            held = dict(self._held(tokens, chain, need_head))
            p = within(sorted(held, reverse=True))  # (a pipeline's lookup: what it raises is the pipeline's)
            found = (p, held[p]) if p in held else None
        if edges is None:
            edges = snapshot_edges(tokens, self.starts, self.stride, self.min_snapshot)
        return PrefillPlan(self, tokens, chain, found, edges, need_head, group=group, found_head=head)


@dataclass
class _Edge:
    p: int
    gdn: list[tuple[mx.array, mx.array]]
    hidden: mx.array  # [1, 1, H] at position p - 1


def _storing(what: str, skipped: int | None = 0) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A ``PrefillPlan`` call that stores (or prepares a store): once one raised (the store out of memory or
    disk, a tier broken), the plan is ``failed``: counted and logged once (``PrefixCache.note_failure``), and this and
    every later store of the sequence is skipped (returns ``skipped``: 0 bytes), never an error of the request."""

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def call(self: PrefillPlan, *args: Any, **kwargs: Any) -> Any:
            if self.failed:
                return skipped
            try:
                return method(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a cache that cannot store is skipped
                self.failed, self._taken = True, []
                self.cache.note_failure(what, e)
                return skipped

        return call

    return wrap


@dataclass
class PrefillPlan:
    """One prompt's use of the cache: what to restore, where its prefill stops, what it captures. At least
    the prompt's last token is always prefilled (its logits give the first token)."""

    cache: PrefixCache
    tokens: list[int]
    chain: list[bytes]
    found: tuple[int, str] | None
    edges: list[int]
    need_head: bool
    group: str | None = None  # the store group of the request's prompt_cache_key
    found_head: bool = True  # whether the head's parts of ``found`` are restored too (when ``need_head``)
    restored: int = 0
    head_row: mx.array | None = None  # the restored prefix's last hidden, for the head
    failed: bool = False  # a store of this sequence raised: it stores nothing more (``_storing``)
    _taken: list[_Edge] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.tokens)

    def restore(self, caches: list[Any], head_cache: KVCache | None) -> bool:
        """Fill fresh ``caches`` (and the head's, when the run drafts: then ``head_row`` is the hidden of the
        prefix's last position [1, 1, H]) with the found prefix. False: nothing restored, prefill from 0 (the
        entries are gone, or reading or joining them raised: ``PrefixCache.note_failure``). Everything is read and
        joined before any cache is touched, so on False the caches are as fresh as they came."""
        if self.found is None:
            return False
        try:
            fill = self._restored(caches, head_cache)
        except Exception as e:  # noqa: BLE001 - an unreadable entry (a tier that raised) is a miss
            self.cache.note_failure("a restore", e)
            return False
        if fill is None:
            return False  # evicted since the lookup: prefill it all
        p, name = self.found
        fill()
        self.restored = p
        c = self.cache
        c._note(name, p)
        c.stats.hits += 1
        c.stats.cached_tokens += p
        return True

    def _restored(self, caches: list[Any], head_cache: KVCache | None) -> Callable[[], None] | None:
        """Read the found prefix's entries and build what each cache will hold; returns what fills them (None:
        an entry is missing). Raises what the store or a malformed entry raises, having touched nothing."""
        assert self.found is not None
        p, name = self.found
        c = self.cache
        m = p // c.block
        g = self.group
        snapshot = c.store.get(c.key(name), g)
        blocks = [c.store.get(c.key(f"b-{self.chain[b].hex()}"), g) for b in range(1, m + 1)]
        heads: list[Arrays | None] = []
        head_tail = None
        if self.need_head and self.found_head and head_cache is not None:
            heads = [c.store.get(c.key(f"h-{self.chain[b].hex()}"), g) for b in range(1, m + 1)]
            head_tail = c.store.get(c.key("sh" + name[1:]), g)
            if head_tail is None or "hidden" not in head_tail or any(h is None for h in heads):
                return None
        if snapshot is None or any(b is None for b in blocks):
            return None
        states: list[tuple[Any, mx.array, mx.array]] = []
        kv: list[tuple[KVCache, tuple[mx.array, mx.array] | None]] = []
        for i, layer_cache in enumerate(caches):
            if isinstance(layer_cache, RollbackArraysCache):
                states.append((layer_cache, snapshot[f"c{i}"], snapshot[f"r{i}"]))
            else:
                parts = [(blk[f"k{i}"], blk[f"v{i}"]) for blk in blocks if blk is not None]
                if f"k{i}" in snapshot:
                    parts.append((snapshot[f"k{i}"], snapshot[f"v{i}"]))
                kv.append((layer_cache, _joined(parts, p)))
        head_kv = None
        if head_tail is not None and head_cache is not None and p > 1:
            parts = [(h["k"], h["v"]) for h in heads if h is not None]
            if "k" in head_tail:
                parts.append((head_tail["k"], head_tail["v"]))
            head_kv = _joined(parts, p - 1)

        def fill() -> None:
            for layer_cache, conv, recurrent in states:
                layer_cache[0], layer_cache[1] = conv, recurrent
            for layer_cache, joined in kv:
                _set_kv(layer_cache, joined, p)
            if head_cache is not None:
                _set_kv(head_cache, head_kv, p - 1)
            if head_tail is not None:
                self.head_row = head_tail["hidden"]

        return fill

    def spans(self, start: int, n: int, chunk: int) -> Iterator[tuple[int, int]]:
        """The prefill's chunks from ``start`` (the restored prefix) to ``n``. A snapshot edge inside a chunk
        does not cut it: the chunk's GatedDeltaNet layers keep their states there (``arm``)."""
        for begin in range(start, n, chunk):
            yield begin, min(begin + chunk, n)

    def inside(self, start: int, end: int) -> list[int]:
        """The snapshot edges strictly inside the chunk ``[start, end)``."""
        return [p for p in self.edges if start < p < end]

    def arm(self, caches: list[Any], start: int, end: int) -> None:
        """Before the forward of the chunk ``[start, end)``: its GatedDeltaNet layers keep their states at the
        snapshot edges inside it (``RollbackArraysCache.arm``), for ``reached``; a store that writes to disk beside
        the device (``exo.runner.prefix_store.TieredStore.quiet``) waits while the chunk runs."""
        quiet = getattr(self.cache.store, "quiet", None)
        if quiet is not None:
            quiet(QUIET_S)
        offsets = [p - start for p in self.inside(start, end) if self._wanted(p)]
        for c in caches:
            if isinstance(c, RollbackArraysCache):
                c.arm(offsets)

    def _wanted(self, p: int) -> bool:
        name = snapshot_key(p, self.chain, self.tokens, self.cache.block)
        return self.need_head or not self.cache.store.has(self.cache.key(name))

    @_storing("keeping a snapshot", None)
    def reached(self, end: int, caches: list[Any], hidden: mx.array, start: int | None = None) -> None:
        """A prefill chunk ``[start, end)`` ended with its hiddens ``hidden`` [1, T, H] (``start``: end - T when
        not given): keep the GatedDeltaNet states at the snapshot edges it reached that are not held yet: inside
        it, as its layers captured them (``arm``), and at its end, the caches' own (references: the caches move
        on to new arrays, these stay)."""
        begin = end - hidden.shape[1] if start is None else start
        for p in [*self.inside(begin, end), end]:
            if p not in self.edges or not self._wanted(p):
                continue
            if p == end:
                gdn = [(c[0], c[1]) if isinstance(c, RollbackArraysCache) else None for c in caches]
            else:
                gdn = [c.captured.get(p - begin) if isinstance(c, RollbackArraysCache) else None for c in caches]
                if any(g is None for g, c in zip(gdn, caches, strict=True) if isinstance(c, RollbackArraysCache)):
                    continue  # a call that captured nothing there (a batch's padded rows): no snapshot at p
            self._taken.append(_Edge(p, gdn, hidden[:, p - 1 - begin : p - begin]))  # type: ignore[arg-type]
        for c in caches:
            if isinstance(c, RollbackArraysCache):
                c.captured = {}

    @_storing("storing a prompt")
    def capture(self, caches: list[Any], head_cache: KVCache | None) -> int:
        """After the prefill (the caches hold the prompt, the head its n - 1 entries when it drafts): store
        the prompt's blocks and the snapshots taken that are not held yet. Returns the bytes stored."""
        c = self.cache
        block = c.block
        n = self.n
        head = head_cache if self.need_head and head_cache is not None and head_cache.offset == n - 1 else None
        entries = self._block_entries(self.chain, n // block, caches, head)
        for edge in self._taken:
            name = snapshot_key(edge.p, self.chain, self.tokens, block)
            entries += self._snapshot_entries(edge.p, name, edge.gdn, caches, head, edge.hidden)
            c._lengths.add(edge.p)
            c._note(name, edge.p)
        self._taken = []
        return self._put(entries)

    @_storing("storing a reply")
    def capture_end(self, fed: Sequence[int], caches: list[Any], head: tuple[KVCache, mx.array] | None = None) -> int:
        """A sequence that ended normally (its reply done): store what its caches hold past the prompt, so the
        next turn (this prompt, the reply as the template renders it, a tool result) restores through the reply.
        ``fed``: the tokens the caches hold (prompt + output, the last output token never fed: at most as many
        as the caches' positions); ``caches``: the sequence's (a batch member's row: ``batch_cache.batch_row``);
        ``head``: the head's cache holding entries 0..len(fed)-2 and the hidden [1, 1, H] of the last fed
        position, where the run fed the head all along. Stores the blocks not held (the reply's) and a snapshot
        at the end: the recurrent state after the last fed token, which the next prompt shares where it
        renders the reply with the same tokens (a lookup's key covers every token before a snapshot, so a
        re-rendered reply that differs simply misses it). Skipped for a reply shorter than a block (its
        snapshot would weigh more than the prefill it saves). Returns the bytes stored."""
        c = self.cache
        block = c.block
        p = len(fed)
        if p - self.n < block or list(fed[: self.n]) != self.tokens:
            return 0
        chain = list(self.chain)
        for b in range(len(chain) - 1, p // block):
            chain.append(_digest(chain[-1], _token_bytes(fed[b * block : (b + 1) * block])))
        head_cache = head[0] if head is not None and head[0].offset == p - 1 else None
        entries = self._block_entries(chain, p // block, caches, head_cache)
        name = snapshot_key(p, chain, fed, block)
        gdn = [(lc[0], lc[1]) if isinstance(lc, RollbackArraysCache) else None for lc in caches]
        entries += self._snapshot_entries(p, name, gdn, caches, head_cache, head[1] if head_cache is not None else None)  # type: ignore[index]
        c._lengths.add(p)
        c._note(name, p)
        return self._put(entries)

    def _block_entries(self, chain: list[bytes], blocks: int, caches: list[Any], head: KVCache | None) -> list[tuple[str, Arrays]]:
        """The attention KV (and the head's entries) of blocks 1..``blocks`` the store does not hold."""
        c = self.cache
        attention = [i for i, lc in enumerate(caches) if not isinstance(lc, RollbackArraysCache)]
        entries: list[tuple[str, Arrays]] = []
        for b in range(1, blocks + 1):
            key = c.key(f"b-{chain[b].hex()}")
            lo, hi = (b - 1) * c.block, b * c.block
            if not c.store.has(key):
                entries.append((key, _kv_slice(caches, attention, lo, hi)))
            hkey = c.key(f"h-{chain[b].hex()}")
            if head is not None and not c.store.has(hkey):
                entries.append((hkey, _head_slice(head, max(lo - 1, 0), hi - 1)))
        return entries

    def _snapshot_entries(self, p: int, name: str, gdn: list[tuple[mx.array, mx.array] | None], caches: list[Any],
                          head: KVCache | None, hidden: mx.array | None) -> list[tuple[str, Arrays]]:
        """A snapshot at ``p`` (the recurrent states ``gdn``, the KV after the last full block) and the head's
        tail (with ``hidden``, position p - 1's), where not held."""
        c = self.cache
        attention = [i for i, lc in enumerate(caches) if not isinstance(lc, RollbackArraysCache)]
        lo = (p // c.block) * c.block
        entries: list[tuple[str, Arrays]] = []
        key = c.key(name)
        if not c.store.has(key):
            arrays: Arrays = {}
            for i, state in enumerate(gdn):
                if state is not None:
                    arrays[f"c{i}"], arrays[f"r{i}"] = _copy(state[0]), _copy(state[1])
            if p > lo:
                arrays.update(_kv_slice(caches, attention, lo, p))
            entries.append((key, arrays))
        hkey = c.key("sh" + name[1:])
        if head is not None and hidden is not None and not c.store.has(hkey):  # (the head consumed these hiddens: computed)
            tail = _head_slice(head, max(lo - 1, 0), p - 1) if p - 1 > max(lo - 1, 0) else {}
            entries.append((hkey, {**tail, "hidden": _copy(hidden)}))
        return entries

    def _put(self, entries: list[tuple[str, Arrays]]) -> int:
        if not entries:
            return 0
        c = self.cache
        mx.eval([a for _, arrays in entries for a in arrays.values()])
        total = 0
        for key, arrays in entries:
            c.store.put(key, arrays, self.group)
            total += nbytes(arrays)
        c.stats.captured_bytes += total
        return total


def _copy(x: mx.array) -> mx.array:
    # A slice of a cache buffer would keep the whole buffer alive; this is a copy of the slice.
    return x * 1  # (exact: an elementwise op writes a fresh buffer)


def _kv_slice(caches: list[Any], attention: list[int], lo: int, hi: int) -> Arrays:
    out: Arrays = {}
    for i in attention:
        out[f"k{i}"] = _copy(caches[i].keys[..., lo:hi, :])
        out[f"v{i}"] = _copy(caches[i].values[..., lo:hi, :])
    return out


def _head_slice(head: KVCache, lo: int, hi: int) -> Arrays:
    return {"k": _copy(head.keys[..., lo:hi, :]), "v": _copy(head.values[..., lo:hi, :])}


def _joined(parts: list[tuple[mx.array, mx.array]], length: int) -> tuple[mx.array, mx.array] | None:
    """Keys and values of ``length`` positions from their parts in order (None: no parts)."""
    if not parts:
        return None
    keys = mx.concatenate([k for k, _ in parts], axis=2) if len(parts) > 1 else parts[0][0]
    values = mx.concatenate([v for _, v in parts], axis=2) if len(parts) > 1 else parts[0][1]
    if keys.shape[2] != length or values.shape[2] != length:
        raise ValueError(f"restored {keys.shape[2]} positions, expected {length}")
    return keys, values


def _set_kv(cache: KVCache, joined: tuple[mx.array, mx.array] | None, length: int) -> None:
    if joined is not None:
        cache.keys, cache.values = joined
        cache.offset = length


# -- the generation loop's hook ---------------------------------------------------------------------------


class NoPlan:
    """No prefix cache: prefill everything in regular chunks, capture nothing."""

    restored = 0
    failed = False

    def spans(self, start: int, n: int, chunk: int) -> Iterator[tuple[int, int]]:
        for begin in range(start, n, chunk):
            yield begin, min(begin + chunk, n)

    def inside(self, start: int, end: int) -> list[int]:
        return []

    def arm(self, caches: list[Any], start: int, end: int) -> None:
        pass

    def reached(self, end: int, caches: list[Any], hidden: mx.array, start: int | None = None) -> None:
        pass

    def capture(self, caches: list[Any], head_cache: KVCache | None) -> int:
        return 0

    def capture_end(self, fed: Sequence[int], caches: list[Any], head: tuple[KVCache, mx.array] | None = None) -> int:
        return 0


def plan_for(cache: PrefixCache | None, tokens: Sequence[int], need_head: bool, stages: int,
             prompt_cache_key: str | None = None, lookup: Callable[[list[int]], list[int]] | None = None) -> PrefillPlan | NoPlan:
    """The plan a run's prefill follows. A pipeline's leader asks the other stages which of the positions it
    holds they hold too (``lookup``: ``PipelineForward.prefix_lookup``; every stage keeps its own layers' part
    under its own namespace) and settles on the deepest all of them hold."""
    if cache is None:
        return NoPlan()
    if stages == 1:
        return cache.plan(tokens, need_head, prompt_cache_key)
    if lookup is None:
        return NoPlan()
    return cache.plan(tokens, need_head, prompt_cache_key, within=lambda held: max(lookup(held), default=0))


class StagePrefix:
    """The prefix cache of a pipeline stage that does not lead (``serve_stage``), for one sequence at a time:
    ``lookup`` (which of the leader's positions this stage holds), ``begin`` (restore the settled position
    into fresh caches, or nothing), then ``step`` after every forward step of the prefill (keeps the
    recurrent states at the leader's snapshot edges, stores the blocks and snapshots once the prompt is in),
    ``end`` (the request is over)."""

    def __init__(self, cache: PrefixCache | None) -> None:
        self.cache = cache
        self.tokens: list[int] = []
        self.plan: PrefillPlan | None = None
        self.position = 0
        self.stored: PrefillPlan | None = None  # the prompt's plan once it is in: the reply's end stores through it

    def lookup(self, tokens: list[int], candidates: list[int]) -> list[int]:
        self.tokens, self.plan, self.stored = list(tokens), None, None
        if self.cache is None or not candidates:
            return []
        chain = block_chain(self.tokens, self.cache.block, self.cache.ns)
        held = {p for p, _ in self.cache._held(self.tokens, chain, False)}
        return [p for p in candidates if p in held]

    def begin(self, caches: list[Any], position: int, edges: list[int], group: str | None) -> bool:
        """Restore ``position`` (0: none) of the prompt of the last ``lookup`` into ``caches`` (fresh); False
        when it cannot (evicted since, or the store raised reading it: ``PrefillPlan.restore``, which leaves
        ``caches`` untouched then): the leader then starts every stage from 0."""
        self.plan, self.position = None, 0
        if self.cache is None:
            return position == 0
        plan = self.cache.plan(self.tokens, False, within=lambda held: position, edges=edges)
        plan.group = group
        if position:
            if plan.found is None or not plan.restore(caches, None):
                return False
        self.plan, self.position = plan, position
        return True

    def arm(self, rows: int, caches: list[Any]) -> None:
        """Before a forward step of ``rows``: its GatedDeltaNet layers keep their states at the leader's snapshot
        edges inside it (``PrefillPlan.arm``)."""
        if self.plan is not None:
            self.plan.arm(caches, self.position, self.position + rows)

    def step(self, rows: int, caches: list[Any], hidden: mx.array) -> None:
        """After a forward step of ``rows`` (its caches evaluated)."""
        if self.plan is None:
            return
        self.position += rows
        self.plan.reached(self.position, caches, hidden, self.position - rows)
        if self.position >= self.plan.n:
            if self.position == self.plan.n:  # the prompt, no more: store it
                self.plan.capture(caches, None)
                self.stored = self.plan
            self.plan = None

    @property
    def failed(self) -> bool:
        """A store of this sequence raised (``PrefillPlan.failed``): ``serve_stage`` drops it, the sequence goes
        on without the prefix cache (the leader's next lookup finds this stage holding less)."""
        plan = self.plan or self.stored
        return plan is not None and plan.failed

    def store_end(self, tokens: list[int], caches: list[Any]) -> int:
        """The sequence ended normally (the leader's ``STORE_END``): store this stage's part of the reply
        (``PrefillPlan.capture_end``), ``tokens`` being what ``caches`` (the sequence's) hold past the prompt.
        Nothing where this stage did not store the prompt, or its caches hold another count of positions."""
        if self.stored is None:
            return 0
        fed = [*self.tokens, *tokens]
        positions = next((c.offset for c in caches if isinstance(c, KVCache)), len(fed))
        return self.stored.capture_end(fed, caches) if positions == len(fed) else 0

    def end(self) -> None:
        self.plan, self.tokens, self.position, self.stored = None, [], 0, None


def restore_prefix(cache: PrefixCache | None, state: Any) -> None:
    """``Engine.start``'s last step: look the prompt up and restore the deepest cached prefix into the new
    sequence state through its seam (``SequenceState.restore``); the plan stays with the state for its
    prefill's chunk edges and the capture after its first token."""
    if state.output.finish is not None:  # cancelled during the engine's warm-up
        return
    forward = state.forward
    tokens = list(state.request.prompt_tokens)
    caches = state.cache  # fresh (a pipeline's: the slot the other stages restore into too)
    lookup = None
    if forward.stages > 1 and hasattr(forward, "prefix_lookup"):
        lookup = functools.partial(forward.prefix_lookup, caches, tokens)
    tracked = state.head.tracked
    plan = plan_for(cache, tokens, tracked, forward.stages, getattr(state.request, "prompt_cache_key", None), lookup)
    state.prefix = plan
    if isinstance(plan, NoPlan):
        return
    head_cache = KVCache() if tracked else None
    if lookup is not None:
        # Every stage restores the settled position (or, where one cannot, all start from 0 again), and
        # learns the leader's snapshot edges: each stores its part of the prompt at the same block edges.
        p = plan.found[0] if plan.found is not None else 0
        if not forward.prefix_begin(caches, p, plan.edges, plan.group):  # (0 always succeeds)
            plan.found = None
            forward.prefix_begin(caches, 0, plan.edges, plan.group)
    if plan.found is None:
        return
    if not plan.restore(caches, head_cache):
        if lookup is not None:  # the leader's own part went missing or unreadable: every stage starts from 0
            forward.prefix_begin(caches, 0, plan.edges, plan.group)
        return
    if head_cache is None or plan.head_row is None:
        state.restore(plan.restored, caches)
    else:
        state.restore(plan.restored, caches, head_cache, plan.head_row)


def store_reply(state: Any, caches: list[Any], owner: list[Any], row: int) -> int:
    """A sequence that ended normally (finish "stop" or "length"; never a cancelled or failed one) keeps its
    generated part in the prefix cache (``PrefillPlan.capture_end``): the next turn resends this prompt and the
    reply. ``caches``: the sequence's (a batch member's row: ``batch_cache.batch_row``), held in ``owner`` at
    ``row`` (-1: its own), which a pipeline's other stages need to find their part: on a pipeline every other
    stage stores its layers' part too (``forward.store_end``: the tokens past the prompt, before the row is
    filtered out or the slot dropped). The head's entries go too where it was fed every position (no gap).
    Returns the bytes stored here (0: nothing, e.g. a reply shorter than a block, or a store that raised:
    logged and counted, ``PrefixCache.note_failure``; the request's reply is never affected)."""
    if state.output.finish not in ("stop", "length"):
        return 0
    positions = next((c.offset for c in caches if isinstance(c, KVCache)), None)
    fed = [*state.request.prompt_tokens, *state.output.tokens]
    # The caches hold the prompt, then the output's tokens in order, the last one never fed; past a finish
    # inside an accepted run they hold drafts after it too: then the state at the end is not this reply's.
    if positions is None or positions > len(fed):
        return 0
    plan = state.prefix
    forward = state.forward
    prompt = getattr(plan, "n", None)  # (None: no plan, nothing to store on any stage)
    if (forward.stages > 1 and prompt is not None and hasattr(forward, "store_end")
            and positions - prompt >= plan.cache.block and not plan.failed):
        forward.store_end(owner, row, fed[prompt:positions])
    return plan.capture_end(fed[:positions], caches, state.head.fed_through(positions))
