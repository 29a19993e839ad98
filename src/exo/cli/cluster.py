"""``exo cluster``: the nodes of the cluster as the local daemon (``exo serve``) sees them."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from exo.cli.common import CommandError, print_json


def fetch_cluster(url: str, api_key: str | None, timeout: float = 5.0) -> dict[str, Any]:
    request = urllib.request.Request(url.rstrip("/") + "/v1/cluster")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise CommandError(f"{url} answered {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise CommandError(f"no exo daemon at {url} ({reason}); start one with `exo serve`") from None


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f}"


def instance_label(inst: dict) -> str:
    """``exo-demo (ready)``; how far it is while its weights download or load: ``qwen (downloading 25%)``."""
    state = inst["state"]
    download = inst.get("download") or {}
    if state == "downloading" and download.get("bytes_total"):
        state += f" {download.get('bytes_done', 0) / download['bytes_total']:.0%}"
    elif state == "loading" and inst.get("progress"):
        state += f" {inst['progress']:.0%}"
    return f"{inst['model']} ({state})"


def cluster_command(args: argparse.Namespace) -> int:
    from exo.settings import load_settings

    settings = load_settings()
    url = args.url or f"http://127.0.0.1:{settings.api_port}"
    view = fetch_cluster(url, settings.api_key.get_secret_value() if settings.api_key else None)
    if args.json:
        print_json(view)
        return 0
    by_node: dict[str, list[str]] = {}
    for inst in view.get("instances", []):
        by_node.setdefault(inst["node"], []).append(instance_label(inst))
    print(f"cluster namespace {view.get('namespace')}: {len(view['nodes'])} node(s), as seen from {url}")
    header = f"{'':2}{'NODE':<14}{'NAME':<20}{'ADDRESS':<22}{'BACKEND':<8}{'CHIP':<28}{'MEM FREE/TOTAL GiB':<20}{'RTT ms':>8}  INSTANCES"
    print(header)
    for node in view["nodes"]:
        mark = "* " if node["self"] else "  "
        address = f"{node['host'] or 'this node'}:{node['grpc_port']}"
        mem = f"{_gib(node['memory_available_bytes'])}/{_gib(node['memory_total_bytes'])}"
        rtt = "-" if node["self"] else f"{node['rtt_ms']:.1f}"
        instances = ", ".join(by_node.get(node["id"], [])) or "-"
        print(
            f"{mark}{node['id'][:12]:<14}{node['name'][:19]:<20}{address[:21]:<22}{node['backend']:<8}"
            f"{node['chip'][:27]:<28}{mem:<20}{rtt:>8}  {instances}"
        )
    gone = [i for i in view.get("instances", []) if i["state"] == "gone"]
    for inst in gone:
        print(f"  gone: {inst['id']} {inst['model']} ({inst.get('gone_reason', '')})", file=sys.stdout)
    return 0
