"""The cluster's HTTP endpoints: ``/v1/instances`` (place, list, inspect, delete, preview) and ``/v1/cluster``.

Served by every node of a cluster (``exo serve``); each answers for the whole cluster as it sees it.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from exo.cluster.orchestration import ClusterModelService
from exo.cluster.views import placement_json

from .config import CONFIG, SERVICE
from .errors import APIError
from .parsing import read_json, validate
from .schemas import InstanceCreate


def add_cluster_routes(app: web.Application) -> None:
    app.router.add_get("/v1/cluster", cluster)
    app.router.add_get("/v1/instances", list_instances)
    app.router.add_post("/v1/instances", create_instance)
    app.router.add_get("/v1/instances/preview", preview)
    app.router.add_get("/v1/instances/{id}", get_instance)
    app.router.add_delete("/v1/instances/{id}", delete_instance)


def _service(request: web.Request) -> ClusterModelService:
    service = request.app[SERVICE]
    assert isinstance(service, ClusterModelService)
    return service


async def cluster(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.to_thread(_service(request).cluster_view))


async def list_instances(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "instances": _service(request).instances_view()})


async def get_instance(request: web.Request) -> web.Response:
    return web.json_response(_service(request).instance_view(request.match_info["id"]))


def _query_int(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise APIError(400, f"{name}: expected an integer, got {raw!r}", param=name, code="invalid_value") from None
    if not lo <= value <= hi:
        raise APIError(400, f"{name}: must be in [{lo}, {hi}], got {value}", param=name, code="invalid_value")
    return value


async def preview(request: web.Request) -> web.Response:
    model = request.query.get("model")
    if not model:
        raise APIError(400, "model: the query parameter `model` is required", param="model",
                       code="missing_required_parameter")
    nodes_text = request.query.get("nodes")
    sharding = request.query.get("sharding") or "pipeline"
    if sharding not in ("pipeline", "tensor", "auto"):
        raise APIError(400, f"sharding: expected pipeline, tensor or auto, got {sharding!r}", param="sharding",
                       code="invalid_value")
    placement_request = InstanceCreate(
        model=model,
        node=request.query.get("node") or None,
        min_nodes=_query_int(request, "min_nodes", 1, 1, 64),
        nodes=[n.strip() for n in nodes_text.split(",")] if nodes_text else None,
        sharding=sharding,  # type: ignore[arg-type]
    )
    placement_request.check_combinations()
    service = _service(request)
    model_id = await asyncio.to_thread(service.model_id, model)
    plan = await asyncio.to_thread(
        service.plan, model_id, placement_request.node, min_nodes=placement_request.min_nodes,
        nodes=placement_request.nodes, sharding=placement_request.sharding,
    )
    # Both splits, each with its estimated speed (what "auto" weighs), whichever was asked for.
    options = await asyncio.to_thread(
        service.plan_options, model_id, placement_request.node, min_nodes=placement_request.min_nodes,
        nodes=placement_request.nodes,
    )
    return web.json_response({"model": model_id, "placement": placement_json(plan, options)})


async def create_instance(request: web.Request) -> web.Response:
    body = validate(InstanceCreate, await read_json(request))
    body.check_combinations()
    service = _service(request)
    arrived = time.monotonic()
    model_id = await asyncio.to_thread(service.model_id, body.model)
    located, plan = await service.create_instance(model_id, body.node, min_nodes=body.min_nodes, nodes=body.nodes,
                                                  replica=body.replica, sharding=body.sharding)
    if body.wait:
        remaining = request.app[CONFIG].load_timeout_s - (time.monotonic() - arrived)
        try:
            await service.wait_ready(located.node_id, located.instance.instance_id, max(0.0, remaining))
        except TimeoutError:
            pass  # answered as it is (loading); the load goes on
    view = service.instance_view(located.instance.instance_id)
    return web.json_response({"instance": view, "placement": placement_json(plan)}, status=201)


async def delete_instance(request: web.Request) -> web.Response:
    instance_id = request.match_info["id"]
    deleted = await _service(request).delete_instance(instance_id)
    return web.json_response({"id": instance_id, "object": "instance.deleted", "deleted": deleted})
