"""Model downloads into the Hugging Face cache, with progress, per-stage shards and MTP head recovery.

Sits beside ``engine`` (it uses the engine's loader to check checkpoints and convert heads) and below
``cluster`` / ``api`` / ``cli``, which it never imports.

    from exo.downloads import HubConfig, PullOptions, ProgressTracker, InProcessSteps, pull_target, prepare, pull
    target = pull_target("qwen3.5-27b-4bit")
    hub = HubConfig.from_env()
    plan = prepare(target, hub, PullOptions())
    result = pull(target, plan, hub, ProgressTracker(), InProcessSteps())

``DownloadManager`` runs pulls in the background for a daemon (``/v1/downloads``).
"""

from .errors import (
    CheckpointRejectedError,
    DownloadCancelledError,
    DownloadError,
    HubUnavailableError,
    InsufficientDiskError,
    OfflineFilesMissingError,
    RepoNotFoundError,
    StageRangeError,
)
from .fetch import DownloadPlan, check_free_disk, fetch, plan_download
from .heads import AGREEMENT_THRESHOLD, measure_agreement, recover_head
from .hub import HubConfig
from .manager import DownloadManager, DownloadNotFoundError, DownloadTask
from .mlx_steps import InProcessSteps, SubprocessSteps
from .progress import DownloadProgress, ProgressTracker
from .pull import PullOptions, PullResult, PullTarget, prepare, pull, pull_target
from .stages import Stage, stage_files, tensor_role

__all__ = [
    "AGREEMENT_THRESHOLD",
    "CheckpointRejectedError",
    "DownloadCancelledError",
    "DownloadError",
    "DownloadManager",
    "DownloadNotFoundError",
    "DownloadPlan",
    "DownloadProgress",
    "DownloadTask",
    "HubConfig",
    "HubUnavailableError",
    "InProcessSteps",
    "InsufficientDiskError",
    "OfflineFilesMissingError",
    "ProgressTracker",
    "PullOptions",
    "PullResult",
    "PullTarget",
    "RepoNotFoundError",
    "Stage",
    "StageRangeError",
    "SubprocessSteps",
    "check_free_disk",
    "fetch",
    "measure_agreement",
    "plan_download",
    "prepare",
    "pull",
    "pull_target",
    "recover_head",
    "stage_files",
    "tensor_role",
]
