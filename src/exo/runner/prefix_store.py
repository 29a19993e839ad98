"""The prefix cache's tiers on a runner: RAM with a byte budget, then disk under ``$EXO_HOME/prefix-cache``
with its own, least recently used out first in each; the disk tier survives a restart.

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
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from exo.engine.prefix_cache import Arrays, MemoryStore, PrefixCache, message_starts, namespace

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
RESCAN_S = 2.0  # a disk tier re-reads its directory (which other instances of the model share) this often at most
STALE_TMP_S = 600.0  # a temporary file untouched this long is a write cut short (a live one is seconds old)
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


def prepare(arrays: Arrays) -> Prepared:
    """On the device thread: each array as its safetensors dtype name and evaluated bytes (bfloat16 viewed
    as uint16, which numpy reads), so the writer thread builds no MLX graph."""
    out = {name: (_NAMES[a.dtype], a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for name, a in arrays.items()}
    mx.eval([a for _, a in out.values()])
    return out


def write_entry(path: Path, prepared: Prepared) -> int:
    """``prepared`` arrays as a safetensors file with a blake2b of its data in the metadata, written to a
    temporary name and renamed (a crash leaves no half file under the real name). Returns its size."""
    header: dict[str, Any] = {}
    chunks: list[bytes] = []
    offset = 0
    for name in sorted(prepared):
        dtype, a = prepared[name]
        raw = np.asarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
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
    except (CorruptEntry, FileNotFoundError):
        raise
    except Exception as e:  # noqa: BLE001 - truncated, garbled, unreadable: all the same to a cache
        raise CorruptEntry(f"{path.name}: {type(e).__name__}: {e}") from e


@dataclass
class TierCounts:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    corrupt: int = 0


class DiskTier:
    """Entries as files in ``root`` (one per key), least recently used out once ``budget_bytes`` is passed.
    Recency survives a restart through the files' modification times.

    The directory is the model's (its namespace), so a restarted runner and a second instance of the model
    on the node use the same files: an entry one wrote is a hit in the other, and one that the other
    deleted (evicted) is an ordinary miss here, not a corrupt one. The index is this process's view of
    the directory, re-read at most every ``rescan_s`` seconds before evicting, so every file counts once
    against the budget whoever wrote it, and the least recently used (by mtime) goes first."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        root.mkdir(parents=True, exist_ok=True)
        self._files: OrderedDict[str, int] = OrderedDict()  # key -> size, least recent first
        self.bytes = 0
        self.counts = TierCounts()
        self.rescan_s = RESCAN_S
        self._scanned = 0.0
        self._lock = threading.Lock()
        self._scan()
        self._evict()

    def _scan(self) -> None:
        """The index from the directory as it is now (ordered by mtime)."""
        found = []
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
        with self._lock:
            self._files = OrderedDict((key, size) for _, key, size in sorted(found))
            self.bytes = sum(self._files.values())
            self._scanned = time.monotonic()

    def _path(self, key: str) -> Path:
        return self.root / (key.replace("/", "__") + SUFFIX)

    def has(self, key: str) -> bool:
        return key in self._files or self._path(key).is_file()  # (written by another instance since the scan)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._files)

    def get(self, key: str) -> Arrays | None:
        path = self._path(key)
        try:
            arrays = read_entry(path)
        except FileNotFoundError:  # never written, or deleted by another instance: a miss like any other
            with self._lock:
                self.bytes -= self._files.pop(key, 0)
                self.counts.misses += 1
            return None
        except CorruptEntry as e:
            log.warning("prefix cache: dropping %s", e)
            self.counts.corrupt += 1
            self.counts.misses += 1
            self.remove(key)
            return None
        try:
            os.utime(path)
            size = path.stat().st_size
        except OSError:
            size = None  # gone meanwhile: what was read checked out, and the index forgets it
        with self._lock:
            self.bytes -= self._files.pop(key, 0)
            if size is not None:
                self._files[key] = size
                self.bytes += size
        self.counts.hits += 1
        return arrays

    def put(self, key: str, prepared: Prepared) -> None:
        if sum(a.nbytes for _, a in prepared.values()) > self.budget_bytes:
            return
        try:
            size = write_entry(self._path(key), prepared)
        except OSError as e:
            log.warning("prefix cache: cannot write %s: %s", key, e)
            return
        with self._lock:
            self.bytes -= self._files.pop(key, 0)
            self._files[key] = size
            self.bytes += size
        self._evict()

    def remove(self, key: str) -> None:
        with self._lock:
            self.bytes -= self._files.pop(key, 0)
        self._path(key).unlink(missing_ok=True)

    def _evict(self) -> None:
        if time.monotonic() - self._scanned >= self.rescan_s:
            self._scan()  # what other instances wrote or deleted meanwhile
        while True:
            with self._lock:
                if self.bytes <= self.budget_bytes or not self._files:
                    return
                key, size = self._files.popitem(last=False)
                self.bytes -= size
                self.counts.evictions += 1
            self._path(key).unlink(missing_ok=True)


def _key(filename: str) -> str:
    return filename[: -len(SUFFIX)].replace("__", "/")


class TieredStore:
    """RAM, then disk (``disk`` None: RAM only). A disk hit is promoted to RAM."""

    def __init__(self, ram_bytes: int, disk: DiskTier | None) -> None:
        self.ram = MemoryStore(ram_bytes)
        self.ram_counts = TierCounts()
        self.disk = disk
        self._writes: queue.Queue[tuple[str, Prepared] | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        if disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="prefix-cache-writer", daemon=True)
            self._writer.start()

    def has(self, key: str) -> bool:
        return self.ram.has(key) or (self.disk is not None and self.disk.has(key))

    def keys(self) -> list[str]:
        keys = set(self.ram.keys())
        if self.disk is not None:
            keys.update(self.disk.keys())
        return sorted(keys)

    def get(self, key: str, group: str | None = None) -> Arrays | None:
        arrays = self.ram.get(key, group)
        if arrays is not None:
            self.ram_counts.hits += 1
            return arrays
        self.ram_counts.misses += 1
        if self.disk is None:
            return None
        arrays = self.disk.get(key)
        if arrays is not None:
            mx.eval(list(arrays.values()))
            self._ram_put(key, arrays, group)
        return arrays

    def put(self, key: str, arrays: Arrays, group: str | None = None) -> None:
        self._ram_put(key, arrays, group)
        if self.disk is not None:
            self._writes.put((key, prepare(arrays)))

    def _ram_put(self, key: str, arrays: Arrays, group: str | None = None) -> None:
        evicted = self.ram.put(key, arrays, group)
        self.ram_counts.evictions += len(evicted)

    def _write_loop(self) -> None:
        assert self.disk is not None
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self.disk.put(*item)
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
        from exo.cluster.system import memory

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
