"""Where downloads come from and go to: the hub endpoint, the token, the cache, and offline mode.

huggingface_hub reads ``HF_ENDPOINT``, ``HF_TOKEN``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` once, at import;
``HubConfig.from_env()`` reads them when a download starts and passes them explicitly, so a daemon (or a
test) that sets them later is honoured. ``EXO_OFFLINE=1`` (the ``offline`` setting) means the same as
``HF_HUB_OFFLINE=1``: only the cache, never the network.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx2
from huggingface_hub import errors as hf_errors

from exo.engine.hf_cache import hub_cache_dir

from .errors import HubUnavailableError, RepoNotFoundError

DEFAULT_ENDPOINT = "https://huggingface.co"
_TRUE = ("1", "true", "yes", "on")
T = TypeVar("T")


@dataclass(frozen=True)
class HubConfig:
    endpoint: str
    cache_dir: Path
    token: str | None = None
    offline: bool = False

    @classmethod
    def from_env(cls, offline: bool = False) -> HubConfig:
        """The environment as it is now; ``offline`` (EXO_OFFLINE) adds to HF_HUB_OFFLINE."""
        hf_offline = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").lower()
        return cls(
            endpoint=(os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/"),
            cache_dir=hub_cache_dir(),
            token=os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None,
            offline=offline or hf_offline in _TRUE,
        )

    @property
    def token_arg(self) -> str | bool | None:
        # None lets huggingface_hub fall back to the token file `hf auth login` writes.
        return self.token

    def common(self) -> dict[str, Any]:
        """Keyword arguments every huggingface_hub download call takes."""
        return {"cache_dir": str(self.cache_dir), "endpoint": self.endpoint, "token": self.token_arg}


def call_hub(repo: str, hub: HubConfig, fn: Callable[[], T]) -> T:
    """Run one huggingface_hub call, its errors as exo's typed ones (others propagate unchanged)."""
    try:
        return fn()
    except hf_errors.GatedRepoError as e:
        raise RepoNotFoundError(
            f"{repo} on {hub.endpoint} is gated: accept its terms on the hub and set HF_TOKEN ({_first_line(e)})"
        ) from None
    except hf_errors.RepositoryNotFoundError:
        hint = "" if hub.token else " (a private repo needs HF_TOKEN)"
        raise RepoNotFoundError(f"{repo} was not found on {hub.endpoint}{hint}") from None
    except hf_errors.RevisionNotFoundError:
        raise RepoNotFoundError(f"{repo} on {hub.endpoint} has no such revision") from None
    except hf_errors.RemoteEntryNotFoundError as e:
        raise RepoNotFoundError(f"{repo} on {hub.endpoint}: a file is missing ({_first_line(e)})") from None
    except hf_errors.HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        if status == 401:
            raise RepoNotFoundError(
                f"{repo} on {hub.endpoint}: the token was refused (HTTP 401); check HF_TOKEN"
            ) from None
        raise HubUnavailableError(f"{hub.endpoint} answered HTTP {status} for {repo}: {_first_line(e)}") from None
    except (httpx2.TransportError, hf_errors.OfflineModeIsEnabled) as e:
        raise HubUnavailableError(
            f"{hub.endpoint} cannot be reached ({type(e).__name__}: {_first_line(e)}); check the network, "
            "HF_ENDPOINT, or work offline with EXO_OFFLINE=1 on files already in the cache"
        ) from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
