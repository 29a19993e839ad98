"""Plan and fetch files of one hub repo into the Hugging Face cache, with progress and cancellation.

The plan is one metadata call (the revision's commit and every file's size); files already in the cache
for that commit are skipped. Each missing file is fetched with ``hf_hub_download`` pinned to the
planned commit, several at once. What huggingface_hub guarantees, and exo relies on:

- a file is written under a unique ``blobs/<etag>.<random>.incomplete`` name and renamed into place
  only when complete, so nothing ever reads a partial file as a whole one, and two processes fetching
  the same file (a per-file lock serialises them) cannot corrupt it;
- a connection that drops mid-file is resumed where it stopped (an HTTP Range request, up to five
  times); a file interrupted for good (cancel, a killed process) is fetched again from its start next
  time, while every file that finished stays in the cache and is not fetched again.

A killed process leaves its partial files behind. A writer holds ``.locks/<repo>/<etag>.lock`` (a
``filelock``, huggingface_hub's) for as long as its ``blobs/<etag>.*.incomplete`` file exists, so when a
fetch starts, the partial files of the repo whose lock nobody holds are orphans, and are deleted
(``remove_orphaned_partials``); a download in flight, in this process or another, keeps its lock and its file.

A last ``snapshot_download`` of the same files at the same commit (nothing left to fetch) records the
repo's file listing in the cache, which lets an offline lookup tell a complete snapshot from a partial
one (``exo.engine.hf_cache``). ``fetch`` never moves the revision's ref: the caller points it at the
commit (``record_ref``) once the files passed its checks, so a lookup by revision (``cached_snapshot``,
``resolve_model``) never lands on a checkpoint that was rejected or is still being filled.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from filelock import FileLock, Timeout
from huggingface_hub import (
    HfApi,
    get_cached_repo_tree,
    hf_hub_download,
    snapshot_download,
    try_to_load_from_cache,
)
from huggingface_hub.errors import CachedRepoTreeNotFoundError
from huggingface_hub.file_download import repo_folder_name

from .errors import (
    DownloadCancelledError,
    DownloadError,
    InsufficientDiskError,
    InvalidRevisionError,
    OfflineFilesMissingError,
)
from .hub import HubConfig, call_hub
from .progress import ProgressTracker, SilentBar

DEFAULT_WORKERS = 4
# Kept free after a download: a full disk breaks more than the download (the OS, swap, other writers).
DEFAULT_RESERVE_BYTES = 1 << 30
Selector = Callable[[list[str]], Iterable[str]]
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")  # git ref names as the hub takes them


@dataclass(frozen=True)
class PlannedFile:
    path: str
    size: int
    cached: bool


@dataclass(frozen=True)
class DownloadPlan:
    repo: str
    revision: str
    commit: str
    files: tuple[PlannedFile, ...]
    offline: bool = False

    @property
    def to_fetch(self) -> tuple[PlannedFile, ...]:
        return tuple(f for f in self.files if not f.cached)

    @property
    def bytes_to_fetch(self) -> int:
        return sum(f.size for f in self.to_fetch)

    @property
    def bytes_cached(self) -> int:
        return sum(f.size for f in self.files if f.cached)


def snapshot_dir(repo: str, commit: str, hub: HubConfig) -> Path:
    return hub.cache_dir / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots" / commit


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def plan_download(repo: str, hub: HubConfig, *, revision: str = "main", select: Selector | None = None) -> DownloadPlan:
    """Which files of ``repo`` (all, or ``select(names)``) are needed, their sizes, and which are cached."""
    if not _REVISION.fullmatch(revision) or ".." in revision:
        raise InvalidRevisionError(f"revision {revision!r} is not a branch, tag or commit name")
    if hub.offline:
        return _plan_offline(repo, hub, revision, select)
    api = HfApi(endpoint=hub.endpoint, token=hub.token_arg)
    info = call_hub(repo, hub, lambda: api.model_info(repo, revision=revision, files_metadata=True))
    if not info.sha:
        raise DownloadError(f"{hub.endpoint} did not say which commit {repo}@{revision} is")
    sizes = {s.rfilename: int(s.size or 0) for s in info.siblings or []}
    return DownloadPlan(repo, revision, info.sha, _planned(repo, hub, info.sha, sizes, select))


def _planned(
    repo: str, hub: HubConfig, commit: str, sizes: dict[str, int], select: Selector | None
) -> tuple[PlannedFile, ...]:
    names = sorted(sizes)
    chosen = sorted(set(select(names))) if select is not None else names
    unknown = [n for n in chosen if n not in sizes]
    if unknown:
        raise DownloadError(f"{repo}@{commit[:8]} has no file(s) {', '.join(unknown[:5])}")
    files = []
    for name in chosen:
        cached = try_to_load_from_cache(repo, name, cache_dir=str(hub.cache_dir), revision=commit)
        files.append(PlannedFile(name, sizes[name], isinstance(cached, str)))
    return tuple(files)


def _plan_offline(repo: str, hub: HubConfig, revision: str, select: Selector | None) -> DownloadPlan:
    why = "offline (EXO_OFFLINE=1 or HF_HUB_OFFLINE=1)"
    try:
        listing = get_cached_repo_tree(repo, revision=revision, cache_dir=str(hub.cache_dir))
    except CachedRepoTreeNotFoundError:
        listing = None
    ref = hub.cache_dir / repo_folder_name(repo_id=repo, repo_type="model") / "refs" / revision
    commit = revision if _COMMIT.fullmatch(revision) else ref.read_text().strip() if ref.is_file() else None
    if commit is None:
        raise OfflineFilesMissingError(
            f"{why}: {repo} is not in the Hugging Face cache ({hub.cache_dir}); run `exo pull` where the hub "
            "can be reached, or unset EXO_OFFLINE / HF_HUB_OFFLINE",
            missing=["(the whole repo)"],
        )
    if listing is not None:
        sizes = {f.path: int(f.size) for f in listing}
    else:  # fetched by a tool that keeps no listing: what the snapshot holds is all that is known
        snapshot = snapshot_dir(repo, commit, hub)
        sizes = {
            str(p.relative_to(snapshot)): p.stat().st_size for p in snapshot.rglob("*") if p.is_file()
        } if snapshot.is_dir() else {}
    files = _planned(repo, hub, commit, sizes, select) if sizes or select is None else ()
    missing = [f.path for f in files if not f.cached]
    if select is not None and not files:
        missing = sorted(select([]))
    if missing:
        listed = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise OfflineFilesMissingError(
            f"{why}: {repo} is only partly in the Hugging Face cache ({hub.cache_dir}); missing {listed} "
            f"({human_bytes(sum(f.size for f in files if not f.cached))}). Run `exo pull` where the hub can "
            "be reached, or unset EXO_OFFLINE / HF_HUB_OFFLINE",
            missing=missing,
        )
    return DownloadPlan(repo, revision, commit, files, offline=True)


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds ``path`` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return shutil.disk_usage("/").free


def check_free_disk(plan: DownloadPlan, hub: HubConfig, reserve_bytes: int = DEFAULT_RESERVE_BYTES) -> None:
    needed = plan.bytes_to_fetch
    if not needed:
        return
    free = free_bytes(hub.cache_dir)
    if free - needed < reserve_bytes:
        raise InsufficientDiskError(
            f"not enough disk for {plan.repo}: {len(plan.to_fetch)} file(s) need {human_bytes(needed)} and "
            f"{human_bytes(reserve_bytes)} must stay free, but {hub.cache_dir} has {human_bytes(free)} free "
            "(free some space, or point HF_HOME at a larger disk)",
            needed_bytes=needed + reserve_bytes,
            free_bytes=free,
        )


def fetch(
    plan: DownloadPlan, hub: HubConfig, tracker: ProgressTracker, *, max_workers: int = DEFAULT_WORKERS
) -> Path:
    """Fetch the plan's missing files (progress and cancellation through ``tracker``); the snapshot path."""
    if plan.offline:
        return snapshot_dir(plan.repo, plan.commit, hub)
    todo = plan.to_fetch
    tracker.add_work(len(todo), sum(f.size for f in todo))
    remove_orphaned_partials(plan.repo, hub)
    if todo:
        _fetch_files(plan, todo, hub, tracker, max_workers)
    tracker.check_cancelled()
    patterns = [glob.escape(f.path) for f in plan.files]
    path = call_hub(
        plan.repo,
        hub,
        lambda: snapshot_download(
            plan.repo, revision=plan.commit, allow_patterns=patterns, tqdm_class=SilentBar, **hub.common()
        ),
    )
    return Path(path)


def remove_orphaned_partials(repo: str, hub: HubConfig) -> list[Path]:
    """Delete the repo's ``.incomplete`` blobs that no live download is writing (a killed pull's); the
    deleted paths. Each etag's lock is tried without waiting: held means in flight, and its files stay."""
    folder = repo_folder_name(repo_id=repo, repo_type="model")
    blobs = hub.cache_dir / folder / "blobs"
    etags = {p.name.split(".", 1)[0] for p in blobs.glob("*.incomplete")} if blobs.is_dir() else set()
    removed: list[Path] = []
    for etag in sorted(etags):
        lock = FileLock(hub.cache_dir / ".locks" / folder / f"{etag}.lock", timeout=0)
        try:
            with lock:  # while held, no download of this blob can start: every partial file of it is an orphan
                for partial in blobs.glob(f"{glob.escape(etag)}.*incomplete"):
                    partial.unlink(missing_ok=True)
                    removed.append(partial)
        except (Timeout, NotImplementedError):  # in flight; or a file system without flock: leave it
            continue
    return removed


def _ref_path(plan: DownloadPlan, hub: HubConfig) -> Path:
    return hub.cache_dir / repo_folder_name(repo_id=plan.repo, repo_type="model") / "refs" / plan.revision


def record_ref(plan: DownloadPlan, hub: HubConfig) -> None:
    """Point ``refs/<revision>`` at the planned commit, once its files are in place and checked: a lookup
    by revision never lands on a snapshot still being filled or rejected, and a branch that moved meanwhile
    does not pull in files nobody planned (the cache layout huggingface_hub documents: the file holds the
    hash)."""
    if plan.revision == plan.commit:
        return
    ref = _ref_path(plan, hub)
    ref.parent.mkdir(parents=True, exist_ok=True)
    if ref.is_file() and ref.read_text().strip() == plan.commit:
        return
    tmp = ref.with_name(f".{ref.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(plan.commit)
    os.replace(tmp, ref)


def forget_ref(plan: DownloadPlan, hub: HubConfig) -> None:
    """Drop ``refs/<revision>`` if it points at the planned commit (a rejected checkpoint, whose ref an
    earlier stage's download recorded)."""
    ref = _ref_path(plan, hub)
    if plan.revision != plan.commit and ref.is_file() and ref.read_text().strip() == plan.commit:
        ref.unlink(missing_ok=True)


def _fetch_files(
    plan: DownloadPlan, todo: tuple[PlannedFile, ...], hub: HubConfig, tracker: ProgressTracker, max_workers: int
) -> None:
    stop = threading.Event()  # set on the first failure, so the other files stop at their next chunk

    def one(file: PlannedFile) -> None:
        if stop.is_set():
            raise DownloadCancelledError("stopped")
        try:
            call_hub(
                plan.repo,
                hub,
                lambda: hf_hub_download(
                    plan.repo,
                    file.path,
                    revision=plan.commit,
                    tqdm_class=tracker.bar_class(file.path, stop),
                    **hub.common(),
                ),
            )
        except BaseException:
            tracker.file_abandoned(file.path)
            raise
        tracker.file_done(file.path, file.size)

    pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(todo))), thread_name_prefix="exo-download")
    futures = [pool.submit(one, file) for file in todo]
    try:
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.exception() is not None for f in done):
            stop.set()
            wait(futures)
    except BaseException:  # KeyboardInterrupt while waiting: stop the workers before leaving
        stop.set()
        wait(futures)
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    errors: list[BaseException] = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
    if errors:  # the first real failure, else the cancellation
        raise next((e for e in errors if not isinstance(e, DownloadCancelledError)), errors[0])
