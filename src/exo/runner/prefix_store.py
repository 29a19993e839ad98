"""The prefix cache's tiers on a runner: RAM with a byte budget, then disk under ``$EXO_HOME/prefix-cache``
with its own, least recently used out first in each (a ``prompt_cache_key`` group's entries as one unit, in
both); the disk tier survives a restart, groups included.

Every entry (a dict of arrays, exo.engine.prefix_cache) is written to disk as it is stored (a writer
thread: the device thread never waits for the disk), so an entry the RAM tier drops is still on disk and a
restarted runner finds everything it wrote. Files are safetensors whose metadata carries a hash of the
data; a file that is truncated, corrupt or unreadable is a miss and is removed, never a wrong state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from exo.engine.prefix_cache import Arrays, GroupedOrder, MemoryStore, PrefixCache, message_starts, namespace

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
RESCAN_S = 2.0  # a disk tier re-reads its directory (which other instances of the model share) this often at most
STALE_TMP_S = 600.0  # a temporary file untouched this long is a write cut short (a live one is seconds old)
GROUP_SUFFIX = ".group"  # an entry's group marker: "<entry's stem>.<group>.group", zero bytes
# A marker superseded or left without its entry this long ago is deleted (a scan may list a new marker and
# miss its entry, written just before it, or list two while another instance moves an entry between groups).
STALE_MARKER_S = 60.0
_GROUP_TOKEN = re.compile(r"[0-9A-Za-z_-]{1,64}")
# safetensors dtype names <-> MLX dtypes, and the numpy dtype their bytes are read as
_DTYPES: dict[str, tuple[Any, Any]] = {
    "F32": (mx.float32, np.float32), "F16": (mx.float16, np.float16), "BF16": (mx.bfloat16, np.uint16),
    "I32": (mx.int32, np.int32), "U32": (mx.uint32, np.uint32), "I64": (mx.int64, np.int64),
    "U8": (mx.uint8, np.uint8),
}
_NAMES = {mlx: name for name, (mlx, _) in _DTYPES.items()}


class CorruptEntry(ValueError):
    """A cache file that cannot be trusted."""


Prepared = dict[str, tuple[str, mx.array]]


def device_memory_apart() -> bool:
    """Whether MLX computes in memory of its own (CUDA): reading an array there from the host (numpy, as the
    writer does) moves its buffer to unified memory, where a later GPU read pages it back in."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def prepare(arrays: Arrays, copy: bool = False) -> Prepared:
    """On the device thread: each array as its safetensors dtype name and evaluated bytes (bfloat16 viewed
    as uint16, which numpy reads), so the writer thread builds no MLX graph. ``copy``: the writer reads copies,
    never the arrays given (on CUDA, its read moves a buffer to host memory: the RAM tier's entry would then
    page back to the GPU at its next restore, in that turn's time to first token)."""
    out = {}
    for name, a in arrays.items():
        if copy:
            a = a * 1  # (exact: an elementwise op writes a fresh buffer of the same dtype)
        out[name] = (_NAMES[a.dtype], a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    mx.eval([a for _, a in out.values()])
    return out


def unprepare(prepared: Prepared) -> Arrays:
    """``prepare``'s arrays back as the entry's own (bfloat16 viewed as such again): what ``read_entry`` would
    read from the file the writer makes of them."""
    return {name: a.view(mx.bfloat16) if dtype == "BF16" else a for name, (dtype, a) in prepared.items()}


def write_entry(path: Path, prepared: Prepared) -> int:
    """``prepared`` arrays as a safetensors file with a blake2b of its data in the metadata, written to a
    temporary name and renamed (a crash leaves no half file under the real name). Returns its size."""
    header: dict[str, Any] = {}
    chunks: list[np.ndarray] = []
    offset = 0
    for name in sorted(prepared):
        dtype, a = prepared[name]
        # The array's own bytes where they are contiguous (no copy under the GIL: hashing and writing them below
        # release it, so the device thread's graph building and decode loop go on beside a large store)
        raw = np.ascontiguousarray(np.asarray(a))
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + raw.nbytes]}
        chunks.append(raw)
        offset += raw.nbytes
    digest = hashlib.blake2b(digest_size=16)
    for raw in chunks:
        digest.update(raw)
    header["__metadata__"] = {"exo.blake2b": digest.hexdigest(), "format": "exo-prefix-cache"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    # Named per writer: two instances of a model share the directory and may write the same entry at once.
    tmp = path.with_name(f"{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)
    os.replace(tmp, path)
    return 8 + len(text) + offset


def read_entry(path: Path) -> Arrays:
    """The arrays of a file ``write_entry`` wrote; CorruptEntry if anything does not check out,
    FileNotFoundError if it is gone."""
    try:
        data = path.read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        body = memoryview(data)[8 + length :]
        meta = header.pop("__metadata__", {})
        digest = hashlib.blake2b(body, digest_size=16).hexdigest()
        if digest != meta.get("exo.blake2b"):
            raise CorruptEntry(f"{path.name}: data does not match its hash")
        out: Arrays = {}
        for name, spec in header.items():
            start, end = spec["data_offsets"]
            mlx_dtype, np_dtype = _DTYPES[spec["dtype"]]
            values = np.frombuffer(body[start:end], dtype=np_dtype).reshape(spec["shape"])
            a = mx.array(values)
            out[name] = a.view(mx.bfloat16) if mlx_dtype == mx.bfloat16 else a
        return out
    except (CorruptEntry, FileNotFoundError, MemoryError):  # (out of memory: the file may well be sound)
        raise
    except Exception as e:  # noqa: BLE001 - truncated, garbled, unreadable: all the same to a cache
        raise CorruptEntry(f"{path.name}: {type(e).__name__}: {e}") from e


@dataclass
class TierCounts:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0
    pending_hits: int = 0  # (RAM's counts) misses served by an entry on its way to disk


class DiskTier:
    """Entries as files in ``root`` (one per key), least recently used out once ``budget_bytes`` is passed.
    Recency survives a restart through the files' modification times.

    Entries used with a ``group`` (a request's ``prompt_cache_key``, as ``MemoryStore`` keeps them) are one unit
    of the least-recently-used order, as in RAM: a group's recency is its most recent entry's mtime, and
    evicting it deletes all its files. An entry belongs to the group that used it last (an entry used without
    one stays in its group); ungrouped entries are units of their own. An entry's group is on disk as a
    zero-byte marker file beside it, ``<entry>.<group>.group``: the entry's own file, its name and what
    ``has`` and ``get`` read stay as they are (files from before groups are ungrouped entries), and a marker
    that loses its entry, or that a newer marker of the entry supersedes (two instances regrouping it at
    once), only misplaces that entry in the order until a scan deletes it.

    The directory is the model's (its namespace), so a restarted runner and a second instance of the model
    on the node use the same files: an entry one wrote is a hit in the other, and one that the other
    deleted (evicted) is an ordinary miss here, not a corrupt one. The index is this process's view of
    the directory, re-read at most every ``rescan_s`` seconds before evicting, so every file counts once
    against the budget whoever wrote it, and the least recently used (by mtime) goes first."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        root.mkdir(parents=True, exist_ok=True)
        self._order = GroupedOrder()  # groups by their tokens (as the markers' names carry them)
        self.counts = TierCounts()
        self.rescan_s = RESCAN_S
        self._scanned = 0.0
        self._lock = threading.Lock()
        self._scan()
        self._evict()

    def _scan(self) -> None:
        """The index from the directory as it is now (ordered by mtime, grouped by the markers)."""
        found = []
        markers: dict[str, list[tuple[int, str, Path]]] = {}
        now = time.time()
        for f in self.root.iterdir():
            try:
                st = f.stat()
            except FileNotFoundError:  # removed meanwhile (by another instance)
                continue
            if f.name.endswith(".tmp"):
                if now - st.st_mtime > STALE_TMP_S:  # a write cut short (a live one may be another instance's)
                    f.unlink(missing_ok=True)
            elif f.name.endswith(SUFFIX):
                found.append((st.st_mtime_ns, _key(f.name), st.st_size))
            elif f.name.endswith(GROUP_SUFFIX) and (marker := _marker_of(f.name)) is not None:
                markers.setdefault(marker[0], []).append((st.st_mtime_ns, marker[1], f))
        present = {key for _, key, _ in found}
        groups: dict[str, str] = {}
        for key, marks in markers.items():
            marks.sort()
            if key in present:
                groups[key] = marks[-1][1]  # the newest marker: the group that used the entry last
                marks.pop()
            for mtime_ns, _, f in marks:  # superseded, or of an entry gone (a marker is made after its entry)
                if now - mtime_ns / 1e9 > STALE_MARKER_S:
                    f.unlink(missing_ok=True)
        with self._lock:
            self._order = GroupedOrder()
            for _, key, size in sorted(found):
                self._order.use(key, size, groups.get(key))
            self._scanned = time.monotonic()

    @property
    def bytes(self) -> int:
        return self._order.bytes

    def _path(self, key: str) -> Path:
        return self.root / (_stem(key) + SUFFIX)

    def _marker(self, key: str, group: str) -> Path:
        return self.root / f"{_stem(key)}.{group}{GROUP_SUFFIX}"

    def _regroup(self, key: str, old: str | None, new: str | None) -> None:
        """The entry's marker moved from group ``old`` to ``new`` (None: ungrouped). Best effort: a marker
        that cannot be written leaves the entry ungrouped (an order, never a wrong state)."""
        if old == new:
            return
        try:
            if new is not None:
                self._marker(key, new).touch()  # (an older marker of that group gets a new mtime: it is the newest)
            if old is not None:
                self._marker(key, old).unlink(missing_ok=True)
        except OSError as e:
            log.warning("prefix cache: cannot group %s: %s", key, e)

    def has(self, key: str) -> bool:
        return key in self._order or self._path(key).is_file()  # (written by another instance since the scan)

    def keys(self) -> list[str]:
        with self._lock:
            return self._order.keys()

    def group_of(self, key: str) -> str | None:
        """The group (as a file name carries it: ``group_token``) ``key`` belongs to in this index."""
        with self._lock:
            return self._order.group(key)

    def get(self, key: str, group: str | None = None) -> Arrays | None:
        """The entry's arrays (None: a miss); ``group``: the using request's, which the entry joins."""
        path = self._path(key)
        try:
            arrays = read_entry(path)
        except FileNotFoundError:  # never written, or deleted by another instance: a miss like any other
            with self._lock:
                self._order.forget(key)
                self.counts.misses += 1
            return None
        except CorruptEntry as e:
            log.warning("prefix cache: dropping %s", e)
            self.counts.corrupt += 1
            self.counts.misses += 1
            self.remove(key)
            return None
        self._used(key, group)
        self.counts.hits += 1
        return arrays

    def touch(self, key: str, group: str | None = None) -> None:
        """``key`` was used (from the RAM tier) by a request of ``group``: it is the most recent, in that group."""
        if self.has(key):
            self._used(key, group)

    def _used(self, key: str, group: str | None) -> None:
        path = self._path(key)
        try:
            os.utime(path)
            size = path.stat().st_size
        except OSError:
            size = None  # gone meanwhile: the index forgets it
        token = group_token(group) if group else None
        with self._lock:
            old = self._order.group(key)
            if size is None:
                self._order.forget(key)
                return
            new = token or old
            self._order.use(key, size, new)
        self._regroup(key, old, new)

    def put(self, key: str, prepared: Prepared, group: str | None = None) -> None:
        if sum(a.nbytes for _, a in prepared.values()) > self.budget_bytes:
            return
        try:
            size = write_entry(self._path(key), prepared)
        except OSError as e:
            log.warning("prefix cache: cannot write %s: %s", key, e)
            return
        token = group_token(group) if group else None
        with self._lock:
            old = self._order.group(key)
            self._order.use(key, size, token)  # (stored without a group: an entry of its own, as in RAM)
        self._regroup(key, old, token)  # (after the entry: a marker never names a file not yet there)
        self._evict()

    def remove(self, key: str) -> None:
        with self._lock:
            group = self._order.forget(key)
        self._path(key).unlink(missing_ok=True)
        if group is not None:
            self._marker(key, group).unlink(missing_ok=True)

    def _evict(self) -> None:
        if time.monotonic() - self._scanned >= self.rescan_s:
            self._scan()  # what other instances wrote or deleted meanwhile
        while True:
            with self._lock:
                if self.bytes <= self.budget_bytes or not len(self._order):
                    return
                # The least recent unit goes whole; the one in use (the only one left) loses its oldest entries.
                group, victims = self._order.victims()
                for key in victims:
                    self._order.forget(key)
                    self.counts.evictions += 1
            for key in victims:
                self._path(key).unlink(missing_ok=True)
                if group is not None:
                    self._marker(key, group).unlink(missing_ok=True)


def group_token(group: str) -> str:
    """A group as a marker's name carries it: itself when it is plain (a PrefixCache's: 16 hex digits), else
    a hash of it."""
    if _GROUP_TOKEN.fullmatch(group):
        return group
    return hashlib.blake2b(group.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def _stem(key: str) -> str:
    return key.replace("/", "__")


def _key(filename: str) -> str:
    return filename[: -len(SUFFIX)].replace("__", "/")


def _marker_of(filename: str) -> tuple[str, str] | None:
    """(key, group) of a marker's name, None if it is not one."""
    stem, _, group = filename[: -len(GROUP_SUFFIX)].rpartition(".")
    if not stem or not _GROUP_TOKEN.fullmatch(group):
        return None
    return stem.replace("__", "/"), group


class TieredStore:
    """RAM, then disk (``disk`` None: RAM only). A disk hit is promoted to RAM."""

    def __init__(self, ram_bytes: int, disk: DiskTier | None, copy_for_disk: bool | None = None) -> None:
        self.ram = MemoryStore(ram_bytes)
        # The writer reads copies where reading would move the RAM tier's entries out of the GPU's memory.
        self.copy_for_disk = device_memory_apart() if copy_for_disk is None else copy_for_disk
        self.ram_counts = TierCounts()
        self.disk = disk
        # The writer's work: (key, prepared, group) to store, (key, None, group) for a RAM hit (the disk's copy is
        # as recent, in the same group: what RAM serves is not the first out of the disk), None to stop.
        self._writes: queue.Queue[tuple[str, Prepared | None, str | None] | None] = queue.Queue()
        # Entries stored and not on disk yet (the writer behind, or waiting out a quiet lease), as the writer will
        # write them: a lookup finds them here when RAM let them go (an entry larger than RAM's budget, or evicted
        # by the next ones), so an agent's next turn, asked before the writer caught up, still hits.
        self._pending: dict[str, tuple[Prepared, str | None]] = {}
        self._pending_lock = threading.Lock()
        self._writer: threading.Thread | None = None
        self._quiet = threading.Condition()
        self._quiet_until = 0.0  # (time.monotonic) the writer waits until then: ``quiet``
        if disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="prefix-cache-writer", daemon=True)
            self._writer.start()

    def has(self, key: str) -> bool:
        if self.ram.has(key):
            return True
        with self._pending_lock:
            if key in self._pending:
                return True
        return self.disk is not None and self.disk.has(key)

    def keys(self) -> list[str]:
        keys = set(self.ram.keys())
        with self._pending_lock:
            keys.update(self._pending)
        if self.disk is not None:
            keys.update(self.disk.keys())
        return sorted(keys)

    def get(self, key: str, group: str | None = None) -> Arrays | None:
        arrays = self.ram.get(key, group)
        if arrays is not None:
            self.ram_counts.hits += 1
            if self.disk is not None:
                self._writes.put((key, None, group))
            return arrays
        self.ram_counts.misses += 1
        if self.disk is None:
            return None
        with self._pending_lock:
            pending = self._pending.get(key)
        if pending is not None:  # stored, out of RAM, not on disk yet: the writer's copy, as the disk will hold it
            arrays = unprepare(pending[0])
            self.ram_counts.pending_hits += 1
        else:
            arrays = self.disk.get(key, group)
            if arrays is None:
                return None
        mx.eval(list(arrays.values()))
        self._ram_put(key, arrays, group)
        return arrays

    def put(self, key: str, arrays: Arrays, group: str | None = None) -> None:
        self._ram_put(key, arrays, group)
        if self.disk is not None:
            prepared = prepare(arrays, self.copy_for_disk)
            with self._pending_lock:
                self._pending[key] = (prepared, group)
            self._writes.put((key, prepared, group))

    def _ram_put(self, key: str, arrays: Arrays, group: str | None = None) -> None:
        evicted = self.ram.put(key, arrays, group)
        self.ram_counts.evictions += len(evicted)

    def quiet(self, seconds: float) -> None:
        """Let the disk writer write nothing for the next ``seconds`` (a lease: renewed by each call, it ends by
        itself). The engine takes one before each prefill chunk (``PrefillPlan.arm``): a cached turn's new tokens
        then prefill without the previous turn's entries being read off the device and written beside them (on
        an H200 that backlog cost a turn's prefill 50-90 ms, docs/performance.md); they go to disk after."""
        if self.disk is None or seconds <= 0:
            return
        with self._quiet:
            self._quiet_until = max(self._quiet_until, time.monotonic() + seconds)
            self._quiet.notify_all()

    def _wait_quiet(self) -> None:
        with self._quiet:
            while (left := self._quiet_until - time.monotonic()) > 0:
                self._quiet.wait(left)

    def _write_loop(self) -> None:
        assert self.disk is not None
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._wait_quiet()
                key, prepared, group = item
                if prepared is not None:
                    try:
                        self.disk.put(key, prepared, group)
                    finally:  # on disk (or never: the disk refused it, as a full disk would evict it)
                        with self._pending_lock:
                            if self._pending.get(key, (None,))[0] is prepared:  # (not a newer put of the key)
                                del self._pending[key]
                else:
                    self.disk.touch(key, group)
            except Exception:  # noqa: BLE001 - a cache write must never take the runner down
                log.exception("prefix cache: write failed")
            finally:
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every stored entry is on disk."""
        if self.disk is not None:
            self._writes.join()

    def close(self) -> None:
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join(timeout=3.0)  # within the runner's graceful exit (GRACEFUL_EXIT_S)

    def figures(self) -> dict[str, int]:
        """Bytes held and counters per tier (what the runner reports)."""
        out = {"ram_bytes": self.ram.bytes, "ram_entries": len(self.ram), "ram_hits": self.ram_counts.hits,
               "ram_evictions": self.ram_counts.evictions, "ram_budget_bytes": self.ram.budget_bytes}
        if self.disk is not None:
            c = self.disk.counts
            out.update(disk_bytes=self.disk.bytes, disk_hits=c.hits, disk_evictions=c.evictions,
                       disk_corrupt=c.corrupt, disk_budget_bytes=self.disk.budget_bytes)
        return out


def ram_budget(settings: Any, reserve_bytes: int, available_bytes: int | None = None) -> int:
    """The RAM tier's budget: ``prefix_cache_ram_bytes``, shrunk to what the node has free once the instance
    holds what placement counted for it. ``available_bytes``: the node's available memory now, with the
    instance's weights loaded (None: as the OS says, within ``memory_budget_bytes``, like placement reads
    it); ``reserve_bytes``: what the instance will still take (its KV budget and activation margin)."""
    if available_bytes is None:
        from exo.system import memory

        available_bytes = memory(settings.memory_budget_bytes).available_bytes
    return max(0, min(settings.prefix_cache_ram_bytes, available_bytes - reserve_bytes))


def open_prefix_cache(loaded: Any, settings: Any, layers: tuple[int, int] | None = None, *,
                      ram_bytes: int | None = None) -> PrefixCache | None:
    """The prefix cache a runner's engine uses, per the node's settings (None: turned off); ``ram_bytes``:
    the RAM tier's budget (None: ``prefix_cache_ram_bytes``; a runner passes ``ram_budget``'s)."""
    if not settings.prefix_cache_enabled or settings.prefix_cache_ram_bytes + settings.prefix_cache_disk_bytes == 0:
        return None
    if ram_bytes is None:
        ram_bytes = settings.prefix_cache_ram_bytes
    ns = namespace(loaded, layers)
    disk = None
    if settings.prefix_cache_disk_bytes > 0:
        try:
            disk = DiskTier(Path(settings.home) / "prefix-cache" / ns, settings.prefix_cache_disk_bytes)
        except OSError as e:
            log.warning("prefix cache: no disk tier (%s)", e)
    store = TieredStore(ram_bytes, disk)
    return PrefixCache(store, ns, block_tokens=settings.prefix_cache_block_tokens,
                       stride_tokens=settings.prefix_cache_stride_tokens,
                       message_starts=message_starts(loaded.tokenizer))
