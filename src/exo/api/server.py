"""The aiohttp application: routes, middlewares (metrics, errors, API key), and running it.

The generation endpoints live in ``completions.py``, the other dialects' in ``anthropic.py``,
``responses.py`` and ``ollama.py``; everything else is small and here. Served with
``handler_cancellation``: a client that goes away cancels its handler, and so its generation. Every
error is a body in the dialect of its path (``dialects.error_body``: OpenAI-style unless the path is
Anthropic's or Ollama's), also aiohttp's own 404/405/413.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
from collections.abc import Callable
from typing import Any

from aiohttp import web

from exo.cluster.orchestration import ClusterModelService
from exo.cluster.service import ModelService
from exo.downloads import DownloadManager
from exo.metrics import Metrics
from exo.settings import Settings

from . import anthropic, ollama, responses
from .completions import chat_completions, completions
from .config import CONFIG, METRICS, NODE, OPENAPI, SERVICE, ServerConfig
from .dashboard import add_dashboard
from .dialects import dialect_of, error_body
from .downloads import add_download_routes
from .errors import APIError, api_error_from
from .instances import add_cluster_routes
from .local import LocalModelService
from .node_settings import NodeSettings
from .openapi import build_openapi
from .parsing import read_json, validate
from .schemas import SettingsUpdate

log = logging.getLogger(__name__)


def create_app(
    service: ModelService, config: ServerConfig, node_settings: NodeSettings, metrics: Metrics
) -> web.Application:
    app = web.Application(
        client_max_size=config.max_body_bytes,
        middlewares=[_metrics_middleware, _error_middleware, _auth_middleware],
    )
    app[SERVICE], app[CONFIG], app[METRICS], app[NODE] = service, config, metrics, node_settings
    app[OPENAPI] = build_openapi()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics_handler)
    app.router.add_get("/openapi.json", openapi_handler)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/settings", get_settings)
    app.router.add_put("/v1/settings", put_settings)
    # The other dialects, on every node (a cluster node's app is this one too): the same generation path.
    app.router.add_post("/v1/messages", anthropic.messages)
    app.router.add_post("/v1/messages/count_tokens", anthropic.count_tokens)
    responses.add_routes(app, node_settings.settings.home)
    ollama.add_routes(app)

    async def close_service(app: web.Application) -> None:
        await asyncio.to_thread(app[SERVICE].close)

    app.on_cleanup.append(close_service)
    return app


def build_cluster_app(
    settings: Settings, service: ClusterModelService, **config_overrides: Any
) -> web.Application:
    """The app of a cluster node (``exo serve``): the same handlers over a ``ClusterModelService``, the
    cluster's endpoints, and the node (gRPC server, peers, runners) started and stopped with the app."""
    config = ServerConfig.from_settings(settings, **config_overrides)
    app = create_app(service, config, NodeSettings(settings, service), service.metrics)
    app[OPENAPI] = build_openapi(cluster=True)
    add_cluster_routes(app)
    # The node's own manager: instances whose weights are missing download through it too (shared).
    add_download_routes(
        app, service.downloads, node_id=lambda: service.node_id, peer_downloads=service.peer_downloads
    )
    add_dashboard(app, service)

    async def start_node(app: web.Application) -> None:
        await service.start()

    async def stop_node(app: web.Application) -> None:
        await service.aclose()

    app.on_startup.append(start_node)
    app.on_cleanup.insert(0, stop_node)
    return app


def build_app(
    settings: Settings,
    *,
    service: LocalModelService | None = None,
    metrics: Metrics | None = None,
    **config_overrides: Any,
) -> web.Application:
    """The app for a node's settings: a LocalModelService (unless given), its metrics and settings."""
    metrics = metrics or (service.metrics if service is not None else Metrics())
    service = service or LocalModelService(settings, metrics=metrics)
    config = ServerConfig.from_settings(settings, **config_overrides)
    app = create_app(service, config, NodeSettings(settings, service), metrics)
    add_download_routes(app, DownloadManager.from_settings(settings))
    return app


# -- middlewares ----------------------------------------------------------------------------------------


@web.middleware
async def _metrics_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        request.app[METRICS].http_requests.labels(request.method, route, str(status)).inc()


@web.middleware
async def _error_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        message = e.text or e.reason
        if e.status == 404:
            message = f"no route {request.method} {request.path}"
        err = APIError(e.status, message, code=codes.get(e.status))
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        err.headers.update(headers)
    except Exception as e:  # noqa: BLE001 - every failure becomes an OpenAI-style body
        err = api_error_from(e)
    request.app[METRICS].errors.labels(err.code or str(err.status)).inc()
    return web.json_response(error_body(dialect_of(request.path), err), status=err.status, headers=err.headers)


@web.middleware
async def _auth_middleware(request: web.Request, handler: Callable) -> web.StreamResponse:
    key = request.app[CONFIG].api_key
    if key and request.path.startswith(("/v1/", "/api/")):
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")  # Anthropic's clients send the key here
        if not hmac.compare_digest(token.strip().encode(errors="replace"), key.encode()):
            raise APIError(
                401,
                "missing or invalid API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
                type="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
    return await handler(request)


# -- small handlers -------------------------------------------------------------------------------------


async def health(request: web.Request) -> web.Response:
    # api_key_required: so a page can ask for the key before its first call instead of after a 401.
    key_required = bool(request.app[CONFIG].api_key)
    return web.json_response({"status": "ok", **request.app[SERVICE].status(), "api_key_required": key_required})


async def metrics_handler(request: web.Request) -> web.Response:
    metrics = request.app[METRICS]
    return web.Response(body=metrics.render(), headers={"Content-Type": metrics.content_type})


async def openapi_handler(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


def _model_object(info: Any) -> dict[str, Any]:
    mtp = info.native_mtp
    return {
        "id": info.id,
        "object": "model",
        "created": info.created,
        "owned_by": info.owned_by,
        "status": info.status,
        "name": info.name,
        "arch": info.arch,
        "context_length": info.context_length,
        "native_mtp": {"default_k": mtp.default_k, "max_k": mtp.max_k, "available": mtp.available, "reason": mtp.reason},
    }


async def list_models(request: web.Request) -> web.Response:
    infos = await asyncio.to_thread(request.app[SERVICE].list_models)
    return web.json_response({"object": "list", "data": [_model_object(i) for i in infos]})


async def get_model(request: web.Request) -> web.Response:
    model = request.match_info["model"]
    infos = await asyncio.to_thread(request.app[SERVICE].list_models)
    for info in infos:
        if info.id == model:
            return web.json_response(_model_object(info))
    raise APIError(404, f"unknown model {model!r}; list models with GET /v1/models", param="model", code="model_not_found")


async def get_settings(request: web.Request) -> web.Response:
    return web.json_response(request.app[NODE].view())


async def put_settings(request: web.Request) -> web.Response:
    update = validate(SettingsUpdate, await read_json(request))
    node = request.app[NODE]
    await asyncio.to_thread(node.update, update.model_dump())
    return web.json_response(node.view())


# -- running --------------------------------------------------------------------------------------------


def run_app(app: web.Application, host: str, port: int, print_fn: Callable[..., None] | None = print) -> None:
    """Serve until interrupted (``exo serve``)."""
    web.run_app(
        app, host=host, port=port, handler_cancellation=True, print=print_fn, access_log=None, shutdown_timeout=5.0
    )


class BackgroundServer:
    """The app served from a thread with its own event loop (tests, benchmarks, notebooks).

        with BackgroundServer(app) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="-")
    """

    def __init__(self, app: web.Application, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            try:
                self._runner = web.AppRunner(
                    self.app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
                )
                loop.run_until_complete(self._runner.setup())
                site = web.TCPSite(self._runner, self.host, self.port)
                loop.run_until_complete(site.start())
                self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            except BaseException as e:  # noqa: BLE001 - reported to start()
                failure.append(e)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=serve, name="exo-api", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
