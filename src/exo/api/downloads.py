"""``/v1/downloads``: download a model onto this node, follow its progress, cancel it.

    POST   /v1/downloads {"model", "revision"?, "recover_head"?, "quantize_head"?}  201 (started) or
           200 (the same model is already downloading: that download; 409 if it has other head options)
    GET    /v1/downloads                  every download this node knows (running, then recent ones) and,
                                          on a cluster node, its peers' (each says its ``node``)
    GET    /v1/downloads/{id}             one, with progress: bytes, total, speed, ETA, files
    GET    /v1/downloads/{id}/events      server-sent events: the download each time it moves, then [DONE]
    DELETE /v1/downloads/{id}             cancel a running download (a finished one is forgotten)

``add_download_routes(app, manager)`` registers them and their OpenAPI entries on an app; a cluster node
passes its id and its peers' downloads (``ClusterModelService.peer_downloads``). A peer's download is
shown here as of the peer's last answer; it is followed (events) and cancelled on that node's API.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

from exo.downloads import (
    DownloadError,
    DownloadManager,
    DownloadNotFoundError,
)
from exo.downloads.progress import Status

from .config import OPENAPI
from .errors import APIError, api_error_from
from .parsing import read_json, validate

DOWNLOADS = web.AppKey("downloads", DownloadManager)
# On a cluster node: (this node's id, the peers' downloads as JSON); absent on a lone server.
CLUSTER_DOWNLOADS = web.AppKey("cluster_downloads", tuple)
EVENT_INTERVAL_S = 0.25
HEARTBEAT_S = 5.0
_STRICT = ConfigDict(extra="forbid", strict=True)


# -- schemas --------------------------------------------------------------------------------------------


class DownloadCreate(BaseModel):
    """``POST /v1/downloads``."""

    model_config = _STRICT

    model: str = Field(min_length=1, max_length=256, description="card id (GET /v1/models) or Hugging Face repo id")
    revision: str = Field(
        default="main", min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]*$",
        description="branch, tag or commit of the repo (no `..`)",
    )
    recover_head: bool = Field(
        default=True, description="recover a stripped MTP head from the card's source_repo (when it has one)"
    )
    quantize_head: bool = Field(default=False, description="quantize a recovered head like the backbone")


class DownloadProgressView(BaseModel):
    bytes_done: int = Field(description="bytes fetched so far (files already in the cache are not counted)")
    bytes_total: int = Field(description="bytes to fetch (grows when the head's shards are added)")
    files_done: int
    files_total: int
    speed_bytes_per_s: float = Field(description="over the last few seconds")
    eta_s: float | None = Field(description="seconds left at the current speed; null when unknown")
    elapsed_s: float
    current_files: list[str]


class DownloadHead(BaseModel):
    status: Literal["present", "recovered", "pending", "refused", "unavailable", "not_declared", "no_source"]
    source_repo: str | None
    agreement: float | None = Field(description="share of the head's drafts the backbone confirms")
    threshold: float | None
    reason: str | None
    quantized: str | None
    files_fetched: int
    bytes_fetched: int


class DownloadResultView(BaseModel):
    model_id: str
    repo: str | None
    path: str | None
    commit: str | None
    bundled: bool
    files_fetched: int
    bytes_fetched: int
    files_cached: int
    stage: dict[str, int | bool] | None
    head: DownloadHead | None
    notes: list[str]


class DownloadFailure(BaseModel):
    code: str
    message: str


class DownloadObject(BaseModel):
    id: str
    object: Literal["download"]
    model: str
    repo: str | None
    revision: str
    status: Status
    progress: DownloadProgressView
    options: dict[str, Any]
    created_at: float
    result: DownloadResultView | None = Field(description="what was fetched (null until complete, and for "
                                                          "a peer's download)")
    error: DownloadFailure | None
    node: str | None = Field(default=None, description="the node it runs on (null: not a cluster node)")


class DownloadList(BaseModel):
    object: Literal["list"]
    data: list[DownloadObject]


class DownloadDeleted(BaseModel):
    id: str
    object: Literal["download.deleted"]
    cancelled: bool = Field(description="true: it was running and is cancelled; false: it had finished")
    deleted: bool


# -- routes ---------------------------------------------------------------------------------------------


def add_download_routes(
    app: web.Application,
    manager: DownloadManager,
    *,
    node_id: Callable[[], str] | None = None,
    peer_downloads: Callable[[], list[dict[str, Any]]] | None = None,
) -> None:
    """Serve ``/v1/downloads`` from ``manager`` (cancelled on shutdown) and document it in the OpenAPI; a
    cluster node adds its id and its peers' downloads."""
    app[DOWNLOADS] = manager
    if node_id is not None and peer_downloads is not None:
        app[CLUSTER_DOWNLOADS] = (node_id, peer_downloads)
    app.router.add_get("/v1/downloads", list_downloads)
    app.router.add_post("/v1/downloads", create_download)
    app.router.add_get("/v1/downloads/{id}", get_download)
    app.router.add_delete("/v1/downloads/{id}", delete_download)
    app.router.add_get("/v1/downloads/{id}/events", download_events)

    async def close(app: web.Application) -> None:
        await asyncio.to_thread(app[DOWNLOADS].close)

    app.on_cleanup.append(close)
    if OPENAPI in app:
        _document(app[OPENAPI])


def _view(request: web.Request, view: dict[str, Any]) -> dict[str, Any]:
    cluster = request.app.get(CLUSTER_DOWNLOADS)
    return {**view, "node": cluster[0]() if cluster else None}


def _peer_download(request: web.Request, download_id: str) -> dict[str, Any] | None:
    cluster = request.app.get(CLUSTER_DOWNLOADS)
    return next((d for d in cluster[1]() if d["id"] == download_id), None) if cluster else None


def _elsewhere(view: dict[str, Any], what: str) -> APIError:
    return APIError(409, f"download {view['id']} runs on node {view['node']}: {what} on that node's API",
                    param="id", code="download_on_other_node")


async def list_downloads(request: web.Request) -> web.Response:
    views = [_view(request, v) for v in await asyncio.to_thread(request.app[DOWNLOADS].views)]
    cluster = request.app.get(CLUSTER_DOWNLOADS)
    if cluster:
        views += cluster[1]()
    return web.json_response({"object": "list", "data": views})


async def create_download(request: web.Request) -> web.Response:
    body = validate(DownloadCreate, await read_json(request))
    manager = request.app[DOWNLOADS]
    try:
        task, started = await asyncio.to_thread(
            manager.start, body.model, revision=body.revision, recover_head=body.recover_head,
            quantize_head=body.quantize_head,
        )
    except DownloadError as e:
        raise api_error_from(e) from None  # the error table's row (offline and missing files: a 404)
    return web.json_response(_view(request, task.view()), status=201 if started else 200)


async def get_download(request: web.Request) -> web.Response:
    try:
        task = request.app[DOWNLOADS].get(request.match_info["id"])
    except DownloadNotFoundError as e:
        peer = _peer_download(request, request.match_info["id"])
        if peer is not None:
            return web.json_response(peer)
        raise api_error_from(e) from None
    return web.json_response(_view(request, task.view()))


async def delete_download(request: web.Request) -> web.Response:
    download_id = request.match_info["id"]
    try:
        _, cancelled = await asyncio.to_thread(request.app[DOWNLOADS].cancel, download_id)
    except DownloadNotFoundError as e:
        peer = _peer_download(request, download_id)
        if peer is not None:
            raise _elsewhere(peer, "cancel it") from None
        raise api_error_from(e) from None
    return web.json_response({"id": download_id, "object": "download.deleted", "cancelled": cancelled, "deleted": True})


async def download_events(request: web.Request) -> web.StreamResponse:
    try:
        task = request.app[DOWNLOADS].get(request.match_info["id"])
    except DownloadNotFoundError as e:
        peer = _peer_download(request, request.match_info["id"])
        if peer is not None:
            raise _elsewhere(peer, "follow it") from None
        raise api_error_from(e) from None
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    sent: tuple[Any, ...] | None = None
    last_sent = 0.0
    loop = asyncio.get_running_loop()
    while True:
        finished = task.finished  # read before the view: the last event is the final state
        view = _view(request, task.view())
        progress = view["progress"]
        moved = (view["status"], progress["bytes_done"], progress["bytes_total"], progress["files_done"])
        if moved != sent or loop.time() - last_sent >= HEARTBEAT_S:
            await response.write(f"data: {json.dumps(view)}\n\n".encode())
            sent, last_sent = moved, loop.time()
        if finished:
            break
        await asyncio.sleep(EVENT_INTERVAL_S)
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


# -- OpenAPI --------------------------------------------------------------------------------------------


def _document(document: dict[str, Any]) -> None:
    from .openapi import _REF, AUTH, BODY, DOWNLOAD, _error_responses, _json, _ref

    _, top = models_json_schema(
        [(DownloadCreate, "validation"), (DownloadObject, "serialization"), (DownloadList, "serialization"),
         (DownloadDeleted, "serialization")],
        ref_template=_REF,
    )
    document.setdefault("components", {}).setdefault("schemas", {}).update(top.get("$defs", {}))
    id_p = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"anyOf": [
            {"const": "[DONE]"},
            {"type": "string", "contentMediaType": "application/json", "contentSchema": _ref(DownloadObject)},
        ]}},
    }
    document["paths"].update({
        "/v1/downloads": {
            "get": {"summary": "downloads on this node (running, then recent) and on its peers (each with its node)",
                    "responses": {"200": _json(DownloadList, "the downloads"), **_error_responses(*AUTH)}},
            "post": {
                "summary": "download a model (card id or repo) into this node's Hugging Face cache; recovers "
                           "a stripped MTP head from the card's source_repo",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(DownloadCreate)}}},
                "responses": {
                    "201": _json(DownloadObject, "started"),
                    "200": _json(DownloadObject, "this model is already downloading: that download"),
                    **_error_responses(*AUTH, *BODY, *DOWNLOAD),
                },
            },
        },
        "/v1/downloads/{id}": {
            "get": {"summary": "one download and its progress", "parameters": [id_p],
                    "responses": {"200": _json(DownloadObject, "the download"), **_error_responses(*AUTH, DownloadNotFoundError)}},
            "delete": {"summary": "cancel a running download (a finished one is forgotten)", "parameters": [id_p],
                       "responses": {"200": _json(DownloadDeleted, "cancelled or forgotten"),
                                     **_error_responses(*AUTH, DownloadNotFoundError,
                                                        "download_on_other_node")}},
        },
        "/v1/downloads/{id}/events": {
            "get": {
                "summary": "server-sent events: the download each time it moves, then [DONE] once it ends",
                "parameters": [id_p],
                "responses": {
                    "200": {"description": "`data: <DownloadObject>` events, ending with `data: [DONE]`",
                            "content": {"text/event-stream": {"schema": event}}},
                    **_error_responses(*AUTH, DownloadNotFoundError, "download_on_other_node"),
                },
            }
        },
    })
