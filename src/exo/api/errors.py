"""OpenAI-style error bodies: every failure a client can see becomes ``{"error": {...}}`` with a status.

``APIError`` is raised inside handlers; ``api_error_from(exc)`` answers any other exception from the one
error table (``exo.wire.errors.ERRORS``: code, status, type, param, Retry-After), which every dialect reads
(``dialects.error_body`` gives each its own shape).
"""

from __future__ import annotations

import logging
from typing import Any

from exo.engine import ContextLengthError
from exo.wire.errors import INTERNAL, message_of, row_of

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error response: HTTP status plus the OpenAI error object (message, type, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# The engine's own type: the API raises it too when it checks a prompt before queueing it.
ContextLengthExceededError = ContextLengthError


def api_error_from(exc: BaseException) -> APIError:
    """The response for an exception raised while serving a request: its row of the error table
    (``exo.wire.errors.ERRORS``), or a logged 500 naming its type."""
    if isinstance(exc, APIError):
        return exc
    row = row_of(exc)
    msg = message_of(exc)
    if row is None:
        log.error("internal error while serving a request", exc_info=exc)
        row, msg = INTERNAL, f"{type(exc).__name__}: {msg}"
    retry = row.retry_after(exc)
    return APIError(
        row.status,
        row.prefix + msg,
        type=row.type,
        param=row.param_of(exc),
        code=row.code_of(exc),
        headers={"Retry-After": str(retry)} if retry else None,
    )
