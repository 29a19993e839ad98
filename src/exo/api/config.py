"""The server's configuration and the typed keys under which the app holds its parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from exo.cluster.service import ModelService
from exo.metrics import Metrics
from exo.settings import Settings

from .node_settings import NodeSettings

DEFAULT_MAX_BODY_BYTES = 8 << 20


@dataclass(frozen=True)
class ServerConfig:
    request_timeout_s: float = 600.0
    load_timeout_s: float = 600.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> ServerConfig:
        values: dict[str, Any] = dict(
            request_timeout_s=settings.request_timeout_s,
            load_timeout_s=settings.request_timeout_s,
            api_key=settings.api_key.get_secret_value() if settings.api_key else None,
        )
        values.update(overrides)
        return cls(**values)


SERVICE = web.AppKey("service", ModelService)
CONFIG = web.AppKey("config", ServerConfig)
METRICS = web.AppKey("metrics", Metrics)
NODE = web.AppKey("node_settings", NodeSettings)
OPENAPI = web.AppKey("openapi", dict)
