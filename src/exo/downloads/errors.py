"""Typed errors of downloads: each says what happened and what to do about it."""

from __future__ import annotations

from exo.engine.loader import CheckpointError
from exo.engine.resolve import ModelNotAvailableError


class DownloadError(Exception):
    """A download could not be done."""

    code = "download_failed"


class RepoNotFoundError(DownloadError, LookupError):
    """The hub has no such repo or revision (or it is private or gated and the token does not open it)."""

    code = "repo_not_found"


class HubUnavailableError(DownloadError):
    """The hub could not be reached, or answered with a server error."""

    code = "hub_unavailable"


class InvalidRevisionError(DownloadError, ValueError):
    """A revision that is not a branch, tag or commit name (it would escape the cache's refs/)."""

    code = "invalid_value"


class OfflineFilesMissingError(DownloadError, ModelNotAvailableError):
    """Offline (EXO_OFFLINE=1 / HF_HUB_OFFLINE=1) and the cache lacks files the download needs."""

    code = "offline_files_missing"

    def __init__(self, message: str, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


class InsufficientDiskError(DownloadError):
    """Not enough free disk for what the download would write."""

    code = "insufficient_disk"

    def __init__(self, message: str, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class DownloadCancelledError(DownloadError):
    """The download was cancelled (its partial files are gone; finished files stay in the cache)."""

    code = "cancelled"


class DownloadConflictError(DownloadError):
    """The model is already downloading with other head options (a download's options are fixed)."""

    code = "download_conflict"

    def __init__(self, message: str, download_id: str) -> None:
        super().__init__(message)
        self.download_id = download_id


class CheckpointRejectedError(DownloadError, CheckpointError):
    """The downloaded files do not form the checkpoint their config and index describe."""

    code = "checkpoint_rejected"


class StageRangeError(ValueError):
    """A pipeline stage's layer range does not fit the model."""


def message(error: BaseException) -> str:
    # LookupError subclasses keep their message in args[0] (str() would add quotes).
    return str(error.args[0]) if isinstance(error, LookupError) and error.args else str(error)
