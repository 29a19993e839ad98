"""Typed errors of downloads: each says what happened and what to do about it."""

from __future__ import annotations

# The download errors a client can see live with the error table (exo.wire.errors); imported here so
# ``exo.downloads.errors`` keeps naming them.
from exo.wire.errors import (
    CheckpointRejectedError,
    DownloadCancelledError,
    DownloadConflictError,
    DownloadError,
    HubUnavailableError,
    InsufficientDiskError,
    InvalidRevisionError,
    OfflineFilesMissingError,
    RepoNotFoundError,
)

__all__ = [
    "CheckpointRejectedError",
    "DownloadCancelledError",
    "DownloadConflictError",
    "DownloadError",
    "HubUnavailableError",
    "InsufficientDiskError",
    "InvalidRevisionError",
    "OfflineFilesMissingError",
    "RepoNotFoundError",
    "StageRangeError",
    "message",
]


class StageRangeError(ValueError):
    """A pipeline stage's layer range does not fit the model."""


def message(error: BaseException) -> str:
    # LookupError subclasses keep their message in args[0] (str() would add quotes).
    return str(error.args[0]) if isinstance(error, LookupError) and error.args else str(error)
