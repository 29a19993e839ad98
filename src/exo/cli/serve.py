"""``exo serve``: the OpenAI-compatible HTTP API on this machine."""

from __future__ import annotations

import argparse
import logging
import sys


def serve_command(args: argparse.Namespace) -> int:
    from exo.api import LocalModelService, build_app, run_app
    from exo.engine import resolve_model
    from exo.settings import load_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = load_settings(cli={"api_host": args.host, "api_port": args.port})
    default_model = None
    service = LocalModelService(settings, max_loaded=args.max_loaded)
    try:
        if args.model is not None:
            resolved = resolve_model(args.model, service.catalog)
            print(f"exo: loading {resolved.model_id} from {resolved.path}", file=sys.stderr)
            default_model = service.register(resolved, load=True)
        service.default_model = default_model or service.default_model
    except BaseException:
        service.close()
        raise
    overrides = {} if args.load_timeout is None else {"load_timeout_s": args.load_timeout}
    app = build_app(settings, service=service, **overrides)
    key = "on" if settings.api_key else "off"
    print(
        f"exo: serving on http://{settings.api_host}:{settings.api_port} (default model "
        f"{service.default_model}, API key {key}, MTP {'on' if service.native_mtp_enabled else 'off'})",
        file=sys.stderr,
    )
    run_app(app, settings.api_host, settings.api_port, print_fn=None)
    return 0
