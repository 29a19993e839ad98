"""Downloads for instances, and a node's downloads as the cluster sees them.

A node asked to run a model (or a pipeline stage of one) whose weights are not on its disk downloads
them first, through the node's ``DownloadManager``: the one behind ``/v1/downloads``, so a download of
the same model (and stage) is shared, never fetched twice. A stage fetches only its stage's files
(``exo.downloads.stages``); a running download of the whole model serves a stage too. The instance is
listed meanwhile (LOADING, stage ``downloading``, with the download's progress); its runner starts when
the files are there. A node that is offline (EXO_OFFLINE / HF_HUB_OFFLINE) downloads nothing.

Stopping an instance that is still downloading does not cancel the download (another instance or a
``/v1/downloads`` client may share it, and the files stay useful): ``DELETE /v1/downloads/{id}`` does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from exo.cards import Catalog, ModelCard, UnknownModelError
from exo.downloads import DownloadError, DownloadManager, DownloadProgress, DownloadTask, Stage
from exo.downloads.errors import message
from exo.engine import ResolvedModel
from exo.wire.proto_gen import node_pb2 as pb

from .supervisor import DownloadReport

POLL_S = 0.25
ENDED_KEPT_S = 600.0  # a node reports its downloads that ended this recently, with their outcome


class InstanceDownloadError(RuntimeError):
    """An instance's weights could not be downloaded (the message says why)."""


class InstanceFetcher:
    """What a node downloads so that an instance of a model can run on it."""

    def __init__(
        self, manager: DownloadManager, catalog: Callable[[], Catalog], offline: Callable[[], bool]
    ) -> None:
        self.manager = manager
        self._catalog = catalog
        self._offline = offline

    def downloadable_card(self, ref: str) -> ModelCard | None:
        """The card of ``ref`` when this node can download its weights (a hub repo, and not offline)."""
        if self._offline():
            return None
        try:
            card = self._catalog().get(ref)
        except (UnknownModelError, LookupError):
            return None
        return card if card.repo is not None else None

    @staticmethod
    def stage_of(card: ModelCard, shard: pb.Shard | None) -> Stage | None:
        """The layers a pipeline stage's shard runs (None: a whole model, or a tensor group's member: it reads a
        slice of every tensor of the checkpoint)."""
        if shard is None or shard.world_size <= 1 or shard.sharding == "tensor":
            return None
        return Stage.of(shard.start_layer, shard.end_layer or card.n_layers, card.n_layers)

    async def fetch(self, card: ModelCard, stage: Stage | None, report: DownloadReport) -> ResolvedModel:
        """Download what the instance needs (progress to ``report``); the model to run once it is there."""
        task = await asyncio.to_thread(self._start, card, stage)
        while not task.finished:
            report(task.id, progress_pb(task.tracker.snapshot()))
            await asyncio.sleep(POLL_S)
        report(task.id, progress_pb(task.tracker.snapshot()))
        what = (
            f"{card.id} ({card.repo})"
            if stage is None
            else (f"layers [{stage.start}, {stage.end}) of {card.id} ({card.repo})")
        )
        if task.tracker.status != "complete" or task.result is None or task.result.path is None:
            why = task.error["message"] if task.error else f"the download was {task.tracker.status}"
            raise InstanceDownloadError(f"downloading {what} failed: {why}")
        return ResolvedModel(Path(task.result.path), card.id, card)

    def _start(self, card: ModelCard, stage: Stage | None) -> DownloadTask:
        # A running download of the model serves the instance whatever head options it was asked with.
        running = self.manager.running(card.id, stage=stage)
        if running is not None:
            return running
        if stage is not None:
            whole = self.manager.running(card.id)
            if whole is not None:
                return whole  # the whole model is on its way: it holds the stage's files too
        try:
            task, _ = self.manager.start(card.id, stage=stage)
        except (DownloadError, LookupError, ValueError) as e:  # planning failed: hub, disk, offline
            raise InstanceDownloadError(f"downloading {card.id} ({card.repo}) failed: {message(e)}") from None
        return task


# -- the cluster's view of downloads --------------------------------------------------------------------


def progress_pb(progress: DownloadProgress) -> pb.DownloadProgress:
    out = pb.DownloadProgress(
        status=progress.status,
        bytes_done=progress.bytes_done,
        bytes_total=progress.bytes_total,
        files_done=progress.files_done,
        files_total=progress.files_total,
        speed_bytes_per_s=progress.speed_bytes_per_s,
        elapsed_s=progress.elapsed_s,
    )
    if progress.eta_s is not None:
        out.eta_s = progress.eta_s
    return out


def node_downloads(manager: DownloadManager, now: float | None = None) -> list[pb.NodeDownload]:
    """A node's downloads for its NodeInfo: running ones, and those that ended in the last ENDED_KEPT_S."""
    now = time.time() if now is None else now
    out = []
    for task in manager.tasks():
        progress = task.tracker.snapshot()
        if task.finished and task.created_at + progress.elapsed_s < now - ENDED_KEPT_S:
            continue
        item = pb.NodeDownload(
            download_id=task.id,
            model_id=task.target.model_id,
            repo=task.target.repo or "",
            revision=task.options.revision,
            progress=progress_pb(progress),
            created_unix=task.created_at,
        )
        stage = task.options.stage
        if stage is not None:
            item.stage.CopyFrom(
                pb.LayerRange(start_layer=stage.start, end_layer=stage.end, n_layers=stage.n_layers)
            )
        if task.error:
            item.error_code, item.error_message = task.error["code"], task.error["message"]
        out.append(item)
    return out
