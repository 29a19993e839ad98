"""exo's OpenAI-compatible HTTP API (``exo serve``), on aiohttp.

    from exo.api import BackgroundServer, build_app
    from exo.settings import load_settings
    with BackgroundServer(build_app(load_settings())) as server:
        ...  # openai.OpenAI(base_url=server.url + "/v1", api_key="-")

Modules: ``server`` (the app, middlewares, small routes, running it), ``completions`` (the two
generation endpoints: parsing, SSE, response shapes), ``service`` (``ModelService``: listing, loading
and generation behind one interface), ``local`` (``LocalModelService``: this machine), ``jobs`` and
``worker`` (the one device thread and its jobs), ``node_settings`` (GET/PUT /v1/settings), ``schemas``
(pydantic request/response bodies), ``errors``, ``metrics``, ``openapi``.
"""

from .cluster import ClusterModelService
from .config import ServerConfig
from .errors import APIError
from .local import LocalModelService
from .metrics import Metrics
from .node_settings import NodeSettings
from .server import BackgroundServer, build_app, build_cluster_app, create_app, run_app
from .service import GenerateParams, ModelInfo, ModelService, Prompt

__all__ = [
    "APIError",
    "BackgroundServer",
    "ClusterModelService",
    "GenerateParams",
    "LocalModelService",
    "Metrics",
    "ModelInfo",
    "ModelService",
    "NodeSettings",
    "Prompt",
    "ServerConfig",
    "build_app",
    "build_cluster_app",
    "create_app",
    "run_app",
]
