"""A small synchronous client for the daemon's HTTP API (``exo serve``), as the menu-bar app uses it.

Synchronous on purpose: the app polls from one background thread and runs actions on another, and
these are a handful of small JSON calls with short timeouts. Every failure becomes a typed error that
says whether anything listens at all (``DaemonUnreachableError.refused``), which is how the app tells
a stopped daemon from a hung one.
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any

from .errors import DaemonAPIError, DaemonUnreachableError


class DaemonAPI:
    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def cluster(self) -> dict[str, Any]:
        return self._call("GET", "/v1/cluster")

    def settings(self) -> dict[str, Any]:
        return self._call("GET", "/v1/settings")

    def put_settings(self, changes: dict[str, Any]) -> dict[str, Any]:
        return self._call("PUT", "/v1/settings", changes)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.api_key and path.startswith("/v1/"):
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as e:
            raise DaemonAPIError(e.code, f"{method} {path} answered {e.code}: {_error_message(e)}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):  # connected (or connecting) but no reply: a hung daemon
                raise self._silent() from None
            refused = isinstance(e.reason, ConnectionRefusedError)
            raise DaemonUnreachableError(
                f"no exo daemon at {self.url} ({e.reason})", refused=refused
            ) from None
        except TimeoutError:
            raise self._silent() from None
        except (OSError, http.client.HTTPException) as e:  # a connection reset or closed mid-reply
            raise DaemonUnreachableError(f"{self.url} broke off the reply ({e!r})", refused=False) from None
        try:
            parsed = json.loads(payload)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise DaemonUnreachableError(
                f"{self.url}{path} is not an exo API (no JSON object)", refused=False
            )
        return parsed

    def _silent(self) -> DaemonUnreachableError:
        return DaemonUnreachableError(
            f"{self.url} does not answer (no reply within {self.timeout:g} s)", refused=False
        )


def _error_message(error: urllib.error.HTTPError) -> str:
    try:
        return str(json.load(error)["error"]["message"])
    except (ValueError, KeyError, TypeError, OSError):
        return str(error.reason)
