"""What the menu shows, as plain data: the daemon's state, the cluster, the models, the MTP toggle.

``Snapshot`` is immutable and built by ``MenubarController.refresh()``; the menu layer renders it and
never talks to the daemon itself. The parsing helpers read the daemon's JSON (``GET /v1/cluster``)
tolerantly: a field the app does not know is ignored, one it needs and cannot find reads as unknown.
"""

from __future__ import annotations

import dataclasses
import enum
from pathlib import Path
from typing import Any


class DaemonState(enum.StrEnum):
    RUNNING = "running"  # /health answers
    STARTING = "starting"  # this app started exo and it does not answer yet
    STOPPING = "stopping"  # this app is stopping its exo
    STOPPED = "stopped"  # nothing listens at the API address
    UNREACHABLE = "unreachable"  # something should answer there and does not (hung, or not exo)


@dataclasses.dataclass(frozen=True)
class ModelStage:
    """One instance (today one per model placement; a pipeline will have one per stage) of a model."""

    instance_id: str
    node_name: str
    state: str  # loading | downloading | ready | failed | stopping | gone
    stage: str  # what its runner is doing: "loading weights", "ready", ...
    progress: float  # loading: the runner's; downloading: the weights' bytes done
    start_layer: int
    end_layer: int
    rank: int
    world_size: int


@dataclasses.dataclass(frozen=True)
class RunningModel:
    model: str
    stages: tuple[ModelStage, ...]


@dataclasses.dataclass(frozen=True)
class ClusterSummary:
    node_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    models: tuple[RunningModel, ...]


@dataclasses.dataclass(frozen=True)
class NativeMTPToggle:
    enabled: bool
    locked_reason: str | None  # set: the environment forces the value; the toggle is shown disabled
    unavailable_reason: str | None  # set: it cannot change right now (exo starting, stopping, hung)
    source: str  # where the value shown came from ("default", "file", "env", "api", ...)

    @property
    def can_change(self) -> bool:
        return self.locked_reason is None and self.unavailable_reason is None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    state: DaemonState
    detail: str | None  # why the state is what it is, when that is worth saying
    api_url: str
    dashboard_url: str
    started_here: bool  # this app started the daemon that runs (so Stop exo and Quit stop it)
    can_start_here: bool  # the API URL is this machine's, so Start exo can start the daemon it watches
    cluster: ClusterSummary | None  # None unless running
    native_mtp: NativeMTPToggle
    log_path: Path
    error: str | None  # the last failed action, until the next action succeeds
    seq: int = 0  # increases with every refresh: a UI drawing from several threads keeps the newest

    @property
    def can_start(self) -> bool:
        return self.state is DaemonState.STOPPED and self.can_start_here

    @property
    def can_stop(self) -> bool:
        return self.started_here and self.state is not DaemonState.STOPPING


def cluster_summary(view: dict[str, Any]) -> ClusterSummary:
    """``GET /v1/cluster`` -> node count, cluster memory, and the models with their stages."""
    nodes = [n for n in view.get("nodes", []) if isinstance(n, dict)]
    names = {str(n.get("id")): str(n.get("name") or str(n.get("id", ""))[:8]) for n in nodes}
    by_model: dict[str, list[ModelStage]] = {}
    for inst in view.get("instances", []):
        if not isinstance(inst, dict):
            continue
        shard = inst.get("shard") or {}
        node = str(inst.get("node", ""))
        stage = ModelStage(
            instance_id=str(inst.get("id", "")),
            node_name=names.get(node, node[:8] or "?"),
            state=str(inst.get("state", "unknown")),
            stage=str(inst.get("stage") or ""),
            progress=_progress(inst),
            start_layer=int(shard.get("start_layer", 0)),
            end_layer=int(shard.get("end_layer", 0)),
            rank=int(shard.get("rank", 0)),
            world_size=int(shard.get("world_size") or 1),
        )
        by_model.setdefault(str(inst.get("model", "?")), []).append(stage)
    models = tuple(
        RunningModel(model, tuple(sorted(stages, key=lambda s: (s.rank, s.instance_id))))
        for model, stages in sorted(by_model.items())
    )
    return ClusterSummary(
        node_count=len(nodes),
        memory_total_bytes=sum(int(n.get("memory_total_bytes") or 0) for n in nodes),
        memory_available_bytes=sum(int(n.get("memory_available_bytes") or 0) for n in nodes),
        models=models,
    )


def _progress(inst: dict) -> float:
    """How far an instance is: its download's bytes while its weights arrive, else its runner's load."""
    download = inst.get("download")
    if inst.get("state") == "downloading" and isinstance(download, dict) and download.get("bytes_total"):
        return float(download.get("bytes_done") or 0) / float(download["bytes_total"])
    return float(inst.get("progress") or 0.0)
