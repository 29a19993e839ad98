"""One pull: a model (card id or repo) into the cache, checked, with its MTP head recovered when stripped.

    target = pull_target("qwen3.5-27b-4bit")              # what to fetch (no network)
    plan = prepare(target, hub, options)                  # which files, how many bytes, disk checked
    result = pull(target, plan, hub, tracker, steps, options)
    print("\\n".join(result.summary_lines()))

``prepare`` is quick (metadata only) and raises the errors a caller wants before anything starts: an
unknown repo, offline with files missing, not enough disk. ``pull`` fetches, checks the checkpoint
against its config (MLX, through ``steps``), and when the card declares ``[native_mtp]`` with a
``source_repo`` and the weights have no head, fetches only the source's shard(s) holding ``mtp.*`` and
recovers the head (``heads.py``). A head that cannot be had does not fail the pull: the result says why.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from exo.cards import Catalog, ModelCard, UnknownModelError, bundled_model_dir, load_catalog
from exo.cards.schema import REPO_PATTERN
from exo.engine.hf_cache import INDEX_FILE, UNUSED_WEIGHT_PATTERNS, missing_checkpoint_files
from exo.engine.loader import MTPHeadError, declared_head_layers, inspect_head, read_config

from .checks import check_index_consistency, read_index
from .errors import CheckpointRejectedError, DownloadCancelledError, DownloadError
from .fetch import (
    DEFAULT_RESERVE_BYTES,
    DEFAULT_WORKERS,
    DownloadPlan,
    check_free_disk,
    fetch,
    forget_ref,
    human_bytes,
    plan_download,
    record_ref,
)
from .heads import PENDING_REASON, PENDING_SIDECAR, head_shards
from .hub import HubConfig
from .mlx_steps import HeadJob, MLXSteps
from .progress import ProgressTracker
from .stages import Stage, stage_files

HeadOutcome = Literal["present", "recovered", "pending", "refused", "unavailable", "not_declared", "no_source"]
_WEIGHT_SUFFIX = ".safetensors"


@dataclass(frozen=True)
class PullTarget:
    model_id: str  # the card id, or the repo for a repo without a card
    repo: str | None  # None: bundled with exo
    card: ModelCard | None

    @property
    def head_source_repo(self) -> str | None:
        mtp = self.card.native_mtp if self.card else None
        return mtp.source_repo if mtp else None


@dataclass(frozen=True)
class PullOptions:
    revision: str = "main"
    recover_head: bool = True
    quantize_head: bool = False
    stage: Stage | None = None  # only what one pipeline stage needs
    max_workers: int = DEFAULT_WORKERS
    reserve_bytes: int = DEFAULT_RESERVE_BYTES


@dataclass
class HeadReport:
    status: HeadOutcome
    source_repo: str | None = None
    agreement: float | None = None
    threshold: float | None = None
    reason: str | None = None
    quantized: str | None = None
    files_fetched: int = 0
    bytes_fetched: int = 0


@dataclass
class PullResult:
    model_id: str
    repo: str | None
    path: str | None
    commit: str | None = None
    bundled: bool = False
    files_fetched: int = 0
    bytes_fetched: int = 0
    files_cached: int = 0
    stage: dict[str, int | bool] | None = None
    head: HeadReport | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary_lines(self) -> list[str]:
        """What ``exo pull`` prints: what was fetched, and what happened to the head."""
        if self.bundled:
            return [f"{self.model_id} is bundled with exo ({self.path}); nothing to download"]
        what = f"{self.model_id} ({self.repo}@{(self.commit or '')[:8]})" if self.repo != self.model_id else (
            f"{self.repo}@{(self.commit or '')[:8]}")
        if self.stage:
            what += f", layers [{self.stage['start']}, {self.stage['end']}) of {self.stage['n_layers']}"
        lines = [
            f"{what}: downloaded {self.files_fetched} file(s), {human_bytes(self.bytes_fetched)}"
            f"{f'; {self.files_cached} already in the cache' if self.files_cached else ''}",
            f"  in {self.path}",
        ]
        head = self.head
        if head is not None:
            if head.status == "recovered":
                quant = f", quantized {head.quantized}" if head.quantized else ""
                lines.append(
                    f"  MTP head recovered from {head.source_repo} ({head.files_fetched} shard(s), "
                    f"{human_bytes(head.bytes_fetched)}{quant}): agreement {head.agreement:.0%} "
                    f"(needs {head.threshold:.0%})"
                )
            elif head.status == "pending":
                lines.append(
                    f"  MTP head converted from {head.source_repo} ({head.files_fetched} shard(s), "
                    f"{human_bytes(head.bytes_fetched)}): {head.reason}"
                )
            elif head.status == "present":
                lines.append(f"  MTP head: present ({head.reason})")
            elif head.status == "not_declared":
                lines.append("  MTP head: this model has none")
            else:
                lines.append(f"  MTP head {head.status}: {head.reason}")
        lines += [f"  {note}" for note in self.notes]
        return lines


def pull_target(ref: str, catalog: Catalog | None = None) -> PullTarget:
    """What ``ref`` (a card id, a card's repo or source repo, or any hub repo) downloads."""
    catalog = catalog if catalog is not None else load_catalog()
    try:
        card = catalog.get(ref)
    except UnknownModelError:
        if re.fullmatch(REPO_PATTERN, ref):
            return PullTarget(ref, ref, None)
        raise
    return PullTarget(card.id, None if card.bundled else card.repo, card)


def is_unused_weight(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in UNUSED_WEIGHT_PATTERNS)


def prepare(target: PullTarget, hub: HubConfig, options: PullOptions, tracker: ProgressTracker | None = None) -> DownloadPlan | None:
    """The plan of a pull (None for a bundled model), with the free disk checked. A stage plan first
    fetches the repo's small files (config, index) to learn which shards the stage needs."""
    if target.repo is None:
        return None
    if options.stage is None:
        plan = plan_download(target.repo, hub, revision=options.revision,
                             select=lambda names: [n for n in names if not is_unused_weight(n)])
    else:
        plan = _stage_plan(target.repo, hub, options, tracker or ProgressTracker())
    check_free_disk(plan, hub, options.reserve_bytes)
    return plan


def _small_files(names: list[str]) -> list[str]:
    return [n for n in names if not n.endswith(_WEIGHT_SUFFIX) and not is_unused_weight(n)]


def _stage_plan(repo: str, hub: HubConfig, options: PullOptions, tracker: ProgressTracker) -> DownloadPlan:
    stage = options.stage
    assert stage is not None
    meta = plan_download(repo, hub, revision=options.revision, select=_small_files)
    snapshot = fetch(meta, hub, tracker, max_workers=options.max_workers)
    weight_map = read_index(snapshot)
    if weight_map:
        weights = stage_files(weight_map, stage.start, stage.end, stage.n_layers, first=stage.first, last=stage.last)
    else:
        weights = ["model.safetensors"]  # one file: every stage needs it whole
    wanted = set(weights)
    plan = plan_download(repo, hub, revision=meta.commit,
                         select=lambda names: [*_small_files(names), *(n for n in names if n in wanted)])
    return replace(plan, revision=meta.revision)  # pinned to the commit; the ref to record is the revision


def pull(
    target: PullTarget,
    plan: DownloadPlan | None,
    hub: HubConfig,
    tracker: ProgressTracker,
    steps: MLXSteps,
    options: PullOptions = PullOptions(),
) -> PullResult:
    """Fetch ``plan``, check it, recover the head; ``tracker`` carries progress and cancellation."""
    if plan is None:
        path = bundled_model_dir(target.card.bundled) if target.card and target.card.bundled else None
        tracker.set_status("complete")
        return PullResult(target.model_id, None, str(path) if path else None, bundled=True)
    tracker.set_status("downloading")
    path = fetch(plan, hub, tracker, max_workers=options.max_workers)
    result = PullResult(
        target.model_id, plan.repo, str(path), plan.commit,
        files_fetched=len(plan.to_fetch), bytes_fetched=plan.bytes_to_fetch,
        files_cached=len(plan.files) - len(plan.to_fetch),
    )
    try:
        _check(target, plan, path, hub, tracker, steps, options, result)
    except CheckpointRejectedError:
        if options.stage is not None or plan.to_fetch:
            # Stage downloads record this commit's ref as each passes its own checks; this pull completed
            # the files and found the whole broken: the ref goes. A pull that fetched nothing found a
            # snapshot someone else made (another tool, the user): its ref is not exo's to delete.
            forget_ref(plan, hub)
        raise
    record_ref(plan, hub)  # only now does a lookup by revision find it
    tracker.set_status("complete")
    return result


def _check(
    target: PullTarget, plan: DownloadPlan, path: Path, hub: HubConfig, tracker: ProgressTracker,
    steps: MLXSteps, options: PullOptions, result: PullResult,
) -> None:
    """Check what was fetched (``CheckpointRejectedError``) and recover the head.

    A stage's shards are checked against the index; its shapes (lazily, with MLX) when it is the last
    stage with a head to convert, and the whole checkpoint's when the stages fetched so far complete the
    model here. The last stage converts a stripped head but cannot check its agreement (the backbone is
    not all here): it is left pending for the pipeline to check (``heads.check_pending_head``)."""
    stage = options.stage
    names = None if stage is None else [f.path for f in plan.files if f.path.endswith(_WEIGHT_SUFFIX)]
    weights = None if names is None else [path / name for name in names]
    head_job = None
    if options.recover_head and (stage is None or stage.last):
        result.head, head_job = _head_plan(target, path, hub, tracker, options, weights)
    tracker.set_status("validating")
    if stage is not None:
        result.stage = {"start": stage.start, "end": stage.end, "n_layers": stage.n_layers,
                        "first": stage.first, "last": stage.last}
    check_index_consistency(path, names)
    whole = stage is None or not missing_checkpoint_files(path)
    if not whole and head_job is None:
        return
    layers = None if whole or stage is None else (stage.start, stage.end)
    answer = steps(path, head_job, tracker.cancel_event, layers)
    if head_job is not None and result.head is not None and answer.get("head"):
        recovered = answer["head"]
        result.head.status = recovered["status"]
        result.head.agreement = recovered["agreement"]
        result.head.threshold = recovered["threshold"]
        result.head.reason = recovered["reason"]
        result.head.quantized = recovered["quantized"]
        if options.quantize_head and result.head.status == "recovered" and not result.head.quantized:
            result.notes.append("the backbone is not affine-quantized: the head was kept in its own dtype")


def _head_plan(
    target: PullTarget, path: Path, hub: HubConfig, tracker: ProgressTracker, options: PullOptions,
    weights: list[Path] | None = None,
) -> tuple[HeadReport, HeadJob | None]:
    """Whether the head must be recovered; if so, fetch the source shards holding it (progress counts).
    ``weights``: a stage's shards (default: the whole checkpoint's)."""
    try:
        declared = declared_head_layers(read_config(path))
        info = inspect_head(path, weights)
    except Exception as e:  # noqa: BLE001 - the checkpoint check that follows reports a broken checkpoint
        return HeadReport("unavailable", reason=f"the head could not be inspected: {e}"), None
    if info.present:
        where = "a sidecar mtp.safetensors" if info.source == "sidecar" else "the weights"
        return HeadReport("present", reason=f"in {where}"), None
    if not declared:
        return HeadReport("not_declared"), None
    source = target.head_source_repo
    if source is None:
        reason = ("the weights have no mtp.* tensors and no card names the official repo holding them"
                  if target.card is None else f"card {target.card.id} has no [native_mtp] source_repo")
        return HeadReport("no_source", reason=reason), None
    if options.stage is not None and (path / PENDING_SIDECAR).is_file():
        return HeadReport("pending", source_repo=source, reason=PENDING_REASON), None
    tracker.set_status("recovering_head")
    try:
        index_plan = plan_download(source, hub, select=lambda names: [n for n in names if n == INDEX_FILE])
        index_path = fetch(index_plan, hub, tracker, max_workers=1)
        weight_map = read_index(index_path)
        shards = head_shards(weight_map) if weight_map else ["model.safetensors"]
        if not shards:
            raise MTPHeadError(f"{source}'s {INDEX_FILE} lists no mtp.* tensors")
        plan = plan_download(source, hub, revision=index_plan.commit, select=lambda names: shards)
        check_free_disk(plan, hub, options.reserve_bytes)
        source_path = fetch(plan, hub, tracker, max_workers=options.max_workers)
        record_ref(index_plan, hub)  # a few files of the source, never a whole checkpoint here
    except DownloadCancelledError:
        raise
    except (DownloadError, MTPHeadError) as e:  # the hub's errors, offline and missing, no head in the source
        message = str(e.args[0]) if isinstance(e, LookupError) and e.args else str(e)
        return HeadReport("unavailable", source_repo=source, reason=f"the head could not be fetched: {message}"), None
    report = HeadReport("unavailable", source_repo=source, files_fetched=len(plan.to_fetch),
                        bytes_fetched=plan.bytes_to_fetch)
    files = tuple(str(source_path / name) for name in shards)
    return report, HeadJob(source, plan.commit, files, options.quantize_head, pending=options.stage is not None)
