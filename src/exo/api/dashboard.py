"""The web dashboard on a node's API port: the built bundle at ``/`` and the state stream ``/v1/events``.

The bundle (``dashboard/`` built by Vite) is committed in the package under ``exo/assets/dashboard``, so
``pip install`` serves it without Node. It is read once, kept in memory with a gzipped copy, and served
with an ETag: ``index.html`` revalidated on every load, the content-hashed ``assets/*`` cached for good.
The page itself needs no API key (``EXO_API_KEY`` guards ``/v1/*`` only); the page asks the user for the
key and sends it with its own API calls, the event stream included.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import mimetypes
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from exo.cluster.orchestration import ClusterModelService
from exo.downloads import DownloadManager

from .config import NODE
from .downloads import DOWNLOADS
from .events import EventHub, Section, stream_events
from .node_settings import NodeSettings

BUNDLE_DIR = Path(__file__).resolve().parents[1] / "assets" / "dashboard"
EVENTS = web.AppKey("events", EventHub)
_BUNDLE = web.AppKey("dashboard_bundle", dict)

# Same-origin only; inline styles are Svelte's style attributes. Model output is rendered as text or
# escaped markdown, and this keeps a slip from running script.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'none'"
)
_COMPRESSIBLE = (".html", ".js", ".css", ".svg", ".json", ".txt")
# Fields of a node or link that move on every reading; a change in them alone is not worth an event.
NODE_NOISE: dict[str, float | None] = {
    "last_seen_s": None,
    "uptime_s": None,
    "rtt_ms": None,
    "memory_available_bytes": 64 << 20,
    "disk_free_bytes": 1 << 30,
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    gzipped: bytes | None
    etag: str
    content_type: str


def load_bundle(root: Path = BUNDLE_DIR) -> dict[str, Asset]:
    """Every file of the built bundle by its URL path (``/`` for index.html)."""
    assets: dict[str, Asset] = {}
    if not (root / "index.html").is_file():
        return assets
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        body = path.read_bytes()
        rel = path.relative_to(root).as_posix()
        content_type = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        if content_type.startswith("text/") or content_type in ("application/javascript", "image/svg+xml"):
            content_type += "; charset=utf-8"
        packed = gzip.compress(body, 9, mtime=0) if path.suffix in _COMPRESSIBLE and len(body) > 512 else None
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        assets["/" if rel == "index.html" else "/" + rel] = Asset(body, packed, etag, content_type)
    return assets


async def serve_asset(request: web.Request) -> web.StreamResponse:
    bundle: dict[str, Asset] = request.app[_BUNDLE]
    path = request.path
    asset = bundle.get(path)
    if asset is None:
        if not bundle:
            raise web.HTTPServiceUnavailable(
                text="the dashboard bundle is missing from this installation: rebuild it with "
                "`npm ci && npm run build` in dashboard/ (the API under /v1 works without it)"
            )
        raise web.HTTPNotFound()
    headers = {"ETag": asset.etag, "Vary": "Accept-Encoding"}
    if path == "/":
        headers["Cache-Control"] = "no-cache"
        headers["Content-Security-Policy"] = CONTENT_SECURITY_POLICY
        headers["X-Content-Type-Options"] = "nosniff"
    else:
        headers["Cache-Control"] = "public, max-age=31536000, immutable"
    if request.headers.get("If-None-Match") == asset.etag:
        return web.Response(status=304, headers=headers)
    body = asset.body
    if asset.gzipped is not None and "gzip" in request.headers.get("Accept-Encoding", ""):
        body = asset.gzipped
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers={**headers, "Content-Type": asset.content_type})


def cluster_sections(
    service: ClusterModelService, node_settings: NodeSettings, downloads: DownloadManager | None = None
) -> list[Section]:
    """The dashboard's state of a cluster node, read from the service, the node's settings and its
    downloads (when the app has them)."""

    def cluster_meta() -> dict[str, Any]:
        return {"node_id": service.node_id, "namespace": service.settings.namespace, "name": service.node.name,
                "version": service.node.version}

    def models() -> list[dict[str, Any]]:
        return [{"object": "model", **dataclasses.asdict(info)} for info in service.list_models()]

    def links() -> list[dict[str, Any]]:
        # Round-trip times move on every poll; the dashboard shows them rounded to a millisecond.
        return [{**link, "rtt_ms": round(link["rtt_ms"])} for link in service.cluster_view()["links"]]

    sections = [
        Section("cluster", cluster_meta),
        Section("nodes", lambda: service.cluster_view()["nodes"], item="node", noise=NODE_NOISE),
        Section("links", links),
        Section("instances", service.instances_view, item="instance"),
        Section("settings", node_settings.view),
        # The catalog reads model directories (headers only): seldom, or when something announced a change.
        Section("models", models, every_s=10.0, blocking=True),
    ]
    if downloads is not None:
        sections.append(Section("downloads", downloads.views, item="download"))
    return sections


def _chain(owner: object, attribute: str, then: Callable[[], None]) -> None:
    """Call ``then()`` after ``owner.attribute(...)``, an optional callback the owner already calls."""
    before = getattr(owner, attribute, None)

    def chained(*args: Any) -> None:
        if before is not None:
            before(*args)
        then()

    setattr(owner, attribute, chained)


def add_dashboard(app: web.Application, service: ClusterModelService) -> EventHub:
    """Serve the bundle and ``/v1/events`` on a cluster node's app; push the node's changes to the hub."""
    hub = EventHub(cluster_sections(service, app[NODE], app.get(DOWNLOADS)))
    app[EVENTS] = hub
    app[_BUNDLE] = load_bundle()

    async def events(request: web.Request) -> web.StreamResponse:
        return await stream_events(request, hub)

    app.router.add_get("/v1/events", events)
    app.router.add_get("/", serve_asset)
    app.router.add_get("/assets/{name:[A-Za-z0-9._-]+}", serve_asset)
    for path in app[_BUNDLE]:
        if path != "/" and not path.startswith("/assets/"):
            app.router.add_get(path, serve_asset)  # favicon and friends at the top level

    # Pushed changes: peers joining or leaving, an instance's state transition on this node ...
    _chain(service.node.registry, "on_joined", hub.notify)
    _chain(service.node.registry, "on_lost", hub.notify)
    _chain(service.node.supervisor, "on_change", hub.notify)

    # ... and every API call that succeeded in changing something (settings, instances, a chat that
    # placed a model on demand).
    async def after_change(request: web.Request, response: web.StreamResponse) -> None:
        if request.method in ("POST", "PUT", "DELETE") and response.status < 400:
            hub.notify()

    app.on_response_prepare.append(after_change)

    async def close_streams(app: web.Application) -> None:
        await hub.close()

    app.on_shutdown.append(close_streams)
    return hub
