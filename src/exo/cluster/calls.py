"""Calls from this node to a peer's ``Node`` service: how long one may take, and what its errors mean here."""

from __future__ import annotations

import grpc

from exo.cards import UnknownModelError
from exo.engine import ModelNotAvailableError

from .service import ClusterAuthError, NodeUnavailableError

CALL_TIMEOUT_S = 5.0
POLL_READY_S = 0.2  # how often a loading instance is asked whether it is ready


def rpc_error(e: grpc.aio.AioRpcError, where: str) -> BaseException:
    """A failed call to ``where`` as the error a request gets for it."""
    code = e.code()
    if code == grpc.StatusCode.NOT_FOUND:
        return UnknownModelError(e.details() or "not found", [])
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ModelNotAvailableError(e.details() or "not available there")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ClusterAuthError(f"{where} refused this node: {e.details()}")
    return NodeUnavailableError(f"{where} did not answer: {code.name}: {e.details()}")
