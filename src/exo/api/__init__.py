"""exo's OpenAI-compatible HTTP API (``exo serve``), on aiohttp.

    from exo.api import BackgroundServer, build_app
    from exo.settings import load_settings
    with BackgroundServer(build_app(load_settings())) as server:
        ...  # openai.OpenAI(base_url=server.url + "/v1", api_key="-")

The HTTP mapping only: requests go to a ``ModelService`` (``exo.cluster.service``), which ``exo serve``
implements with ``exo.cluster.orchestration.ClusterModelService`` (models in runner processes anywhere in
the cluster) and ``local.LocalModelService`` implements in this process (notebooks, benchmarks, tests).

Modules: ``server`` (the app, middlewares, small routes, running it), ``completions`` (the two
generation endpoints: parsing, SSE, response shapes; ``ChatGeneration``, the path the other dialects
share), ``anthropic`` / ``responses`` / ``ollama`` (the Anthropic Messages, OpenAI Responses and Ollama
dialects), ``dialects`` (what they share: error shapes, message helpers), ``instances`` (``/v1/instances``, ``/v1/cluster``),
``local``, ``node_settings`` (GET/PUT /v1/settings), ``schemas`` (pydantic request/response bodies),
``errors`` (typed errors -> OpenAI-style bodies), ``openapi``.
"""

from exo.cluster.orchestration import ClusterModelService
from exo.cluster.service import GenerateParams, ModelInfo, ModelService, Prompt
from exo.metrics import Metrics

from .config import ServerConfig
from .errors import APIError
from .local import LocalModelService
from .node_settings import NodeSettings
from .server import BackgroundServer, build_app, build_cluster_app, create_app, run_app

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
