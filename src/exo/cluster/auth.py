"""The optional cluster secret (``EXO_CLUSTER_SECRET``): HMAC-SHA256 signatures in gRPC metadata.

Every call carries ``x-exo-node`` (the caller's node id), ``x-exo-ts`` (unix seconds), ``x-exo-nonce``
(random) and ``x-exo-sig`` = hex HMAC-SHA256(secret, method, ts, node, nonce joined by newlines). A
node with a secret answers UNAUTHENTICATED to a call without a valid signature, with a timestamp more
than ``REPLAY_WINDOW_S`` away from its clock, or with a nonce it has already seen inside that window
(so a captured call cannot be replayed). GetNodeInfo answers carry a proof (HMAC over the caller's
challenge) so the caller knows the peer holds the secret too: a node without it cannot join, command
or see a secured cluster. The signature covers who calls what and when, not the request body, and
nothing is encrypted: on untrusted networks run the cluster inside a VPN or TLS tunnel.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

REPLAY_WINDOW_S = 30.0
_NODE, _TS, _NONCE, _SIG = "x-exo-node", "x-exo-ts", "x-exo-nonce", "x-exo-sig"


class ClusterAuth:
    def __init__(self, secret: str | None, *, clock: Callable[[], float] = time.time) -> None:
        self._key = secret.encode() if secret else None
        self._clock = clock
        self._seen: dict[str, float] = {}  # nonce -> when it stops mattering

    @property
    def enabled(self) -> bool:
        return self._key is not None

    def _mac(self, *parts: str) -> str:
        assert self._key is not None
        return hmac.new(self._key, "\n".join(parts).encode(), hashlib.sha256).hexdigest()

    def metadata(self, method: str, node_id: str) -> tuple[tuple[str, str], ...]:
        """The metadata of one outgoing call (empty without a secret)."""
        if self._key is None:
            return ()
        ts = f"{self._clock():.3f}"
        nonce = secrets.token_hex(12)
        return ((_NODE, node_id), (_TS, ts), (_NONCE, nonce), (_SIG, self._mac(method, ts, node_id, nonce)))

    def check(self, method: str, metadata: Sequence[Any] | None) -> str | None:
        """None when the call may proceed, else why not."""
        if self._key is None:
            return None
        values = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
        node, ts, nonce, sig = (values.get(k) for k in (_NODE, _TS, _NONCE, _SIG))
        if not (node and ts and nonce and sig):
            return "this node requires the cluster secret (EXO_CLUSTER_SECRET): the call is not signed"
        try:
            sent = float(ts)
        except ValueError:
            return "malformed signature timestamp"
        if not math.isfinite(sent):
            return "malformed signature timestamp"
        now = self._clock()
        if abs(now - sent) > REPLAY_WINDOW_S:
            return f"signature timestamp is {now - sent:+.0f} s off this node's clock (window {REPLAY_WINDOW_S:g} s)"
        if not hmac.compare_digest(sig, self._mac(method, ts, node, nonce)):
            return "invalid signature: the caller's cluster secret differs"
        self._forget_old(now)
        if nonce in self._seen:
            return "replayed call (nonce already seen)"
        self._seen[nonce] = now + 2 * REPLAY_WINDOW_S
        return None

    def _forget_old(self, now: float) -> None:
        if len(self._seen) > 4096 or (self._seen and next(iter(self._seen.values())) < now):
            self._seen = {n: t for n, t in self._seen.items() if t >= now}

    def proof(self, challenge: str, node_id: str) -> str:
        return self._mac("proof", challenge, node_id) if self._key is not None else ""

    def check_proof(self, challenge: str, node_id: str, proof: str) -> bool:
        """Whether a peer's answer proves it holds our secret (always True without one)."""
        if self._key is None:
            return True
        return bool(proof) and hmac.compare_digest(proof, self.proof(challenge, node_id))


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects every call that ``ClusterAuth.check`` refuses, with UNAUTHENTICATED."""

    def __init__(self, auth: ClusterAuth) -> None:
        self.auth = auth

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        reason = self.auth.check(details.method, details.invocation_metadata)
        if reason is None or handler is None:
            return handler

        async def deny_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

        async def deny_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
            yield  # pragma: no cover - makes this an async generator

        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming else grpc.unary_unary_rpc_method_handler
        return make(
            deny_stream if handler.response_streaming else deny_unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
