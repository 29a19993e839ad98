"""Errors that cross the wire: raised where a generation runs, answered the same way wherever it was asked.

A runner reports them in a ``GenerateError`` (``convert.error_to_pb``); the API node turns that back into
the same type (``convert.error_from_pb``), and the HTTP layer maps the type to a status. So a request
gets the same answer whether its model runs in-process, on this node's runner or on another node.
"""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """The device's request queue is full; retry after ``retry_after_s`` (HTTP 429)."""

    def __init__(self, waiting: int, retry_after_s: int, message: str | None = None) -> None:
        super().__init__(
            message or f"the request queue is full ({waiting} requests waiting); retry in {retry_after_s} s"
        )
        self.retry_after_s = retry_after_s


class RequestTimeoutError(TimeoutError):
    """The request ran past the server's request timeout (while queued or while generating)."""


class NodeUnavailableError(RuntimeError):
    """The node, runner or pipeline stage that serves an instance stopped answering, left, or is not ready."""
