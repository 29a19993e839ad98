"""The cluster's state as plain JSON-ready data: instances, nodes, placements (what ``/v1/cluster``,
``/v1/instances`` and the dashboard's events carry)."""

from __future__ import annotations

import dataclasses
from typing import Any

from exo.wire.proto_gen import node_pb2 as pb

from . import placement as pl

STATE_NAMES = {
    pb.INSTANCE_STATE_LOADING: "loading",
    pb.INSTANCE_STATE_READY: "ready",
    pb.INSTANCE_STATE_FAILED: "failed",
    pb.INSTANCE_STATE_STOPPING: "stopping",
}


def instance_json(inst: pb.Instance, node_id: str, self_id: str) -> dict[str, Any]:
    failure = None
    if inst.HasField("failure"):
        f = inst.failure
        failure = {"exit_code": f.exit_code, "message": f.message, "stderr_tail": list(f.stderr_tail),
                   "at": f.at_unix}
    s = inst.model
    return {
        "id": inst.instance_id,
        "object": "instance",
        "model": inst.model_id,
        "model_ref": inst.model_ref,
        "node": node_id,
        "self": node_id == self_id,
        "state": STATE_NAMES.get(inst.state, "failed"),
        "progress": round(inst.progress, 4),
        "stage": inst.stage,
        "shard": {"start_layer": inst.shard.start_layer, "end_layer": inst.shard.end_layer,
                  "rank": inst.shard.rank, "world_size": inst.shard.world_size or 1},
        "failure": failure,
        "restarts": inst.restarts,
        "pid": inst.pid,
        "created": inst.created_unix,
        "updated": inst.updated_unix,
        "on_demand": inst.on_demand,
        "queue_depth": inst.queue_depth,
        "running": inst.running,
        "native_mtp": {
            "available": s.mtp_available,
            "reason": s.mtp_reason or None,
            "default_k": s.default_k or None,
            "max_k": s.max_k or None,
        } if inst.HasField("model") else None,
    }


def node_json(
    info: pb.NodeInfo, *, self_id: str, host: str | None, last_seen_s: float, rtt_ms: float, source: str
) -> dict[str, Any]:
    return {
        "id": info.node_id,
        "name": info.name,
        "self": info.node_id == self_id,
        "host": host,
        "api_port": info.api_port,
        "grpc_port": info.grpc_port,
        "version": info.version,
        "namespace": info.namespace,
        "memory_total_bytes": info.memory_total_bytes,
        "memory_available_bytes": info.memory_available_bytes,
        "chip": info.chip,
        "backend": info.backend,
        "disk_free_bytes": info.disk_free_bytes,
        "platform": info.platform,
        "cpu_count": info.cpu_count,
        "uptime_s": round(info.uptime_s, 3),
        "secured": info.secured,
        "models": [m.model_id for m in info.models],
        "instances": [i.instance_id for i in info.instances],
        "last_seen_s": round(last_seen_s, 3),
        "rtt_ms": round(rtt_ms, 3),
        "source": source,
    }


def placement_json(plan: pl.Placement) -> dict[str, Any]:
    req = plan.requirement
    return {
        "model": plan.model_id,
        "node": plan.node_id,
        "needed_bytes": req.needed_bytes,
        "weights_bytes": req.weights_bytes,
        "kv_bytes": req.kv_bytes,
        "context_tokens": req.context_tokens,
        "activation_bytes": req.activation_bytes,
        "node_free_bytes": plan.node_free_bytes,
        "headroom_bytes": plan.headroom_bytes,
        "shards": [dataclasses.asdict(s) for s in plan.shards],
    }

