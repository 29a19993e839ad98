"""``exo serve``: this machine as a node of an exo cluster, serving the OpenAI-compatible HTTP API.

A node alone is a cluster of one. Models run in runner subprocesses (instances) on whichever node
placement picks; the API of any node serves every model of the cluster.
"""

from __future__ import annotations

import argparse
import logging
import sys


def serve_command(args: argparse.Namespace) -> int:
    from exo.api import build_cluster_app, run_app
    from exo.cluster.orchestration import ClusterModelService
    from exo.cluster.supervisor import InstanceFailedError
    from exo.engine import resolve_model
    from exo.settings import load_settings
    from exo.wire.errors import PlacementError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    settings = load_settings(
        cli={
            "api_host": args.host,
            "api_port": args.port,
            "grpc_port": args.grpc_port,
            "peers": args.peers,
            "namespace": args.namespace,
            "discovery": False if args.no_discovery else None,
            "memory_budget_bytes": args.memory_budget,
        }
    )
    service = ClusterModelService(settings, max_loaded=args.max_loaded, name=args.name)
    preload = None
    if args.model is not None:
        resolved = resolve_model(args.model, service.catalog)  # a directory, card or repo on this machine
        service.default_model = service.register(resolved)
        preload = resolved.model_id
    overrides = {} if args.load_timeout is None else {"load_timeout_s": args.load_timeout}
    app = build_cluster_app(settings, service, **overrides)

    async def announce(app: object) -> None:
        if preload is not None:
            print(f"exo: loading {preload} on this node", file=sys.stderr)
            try:
                located, _ = await service.create_instance(preload, service.node_id)
                await service.wait_ready(located.node_id, located.instance.instance_id, timeout=None)
            except (PlacementError, InstanceFailedError) as e:
                print(f"exo: error: {e}", file=sys.stderr)
                raise SystemExit(1) from None
        print(
            f"exo: serving on http://{settings.api_host}:{settings.api_port} as node {service.node_id}, gRPC port "
            f"{service.node.grpc_port} (namespace {settings.namespace}, default model {service.default_model}, "
            f"API key {'on' if settings.api_key else 'off'}, cluster secret "
            f"{'on' if settings.cluster_secret else 'off'}, MTP {'on' if service.native_mtp_enabled else 'off'})",
            file=sys.stderr,
            flush=True,
        )

    app.on_startup.append(announce)
    run_app(app, settings.api_host, settings.api_port, print_fn=None)
    return 0
