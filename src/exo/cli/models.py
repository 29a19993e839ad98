"""``exo models``: the catalog, local models first."""

from __future__ import annotations

import argparse

from exo.cli.common import print_json


def models_command(args: argparse.Namespace) -> int:
    from exo.cards import load_catalog
    from exo.engine.resolve import local_path

    catalog = load_catalog()
    rows = []
    for card in catalog.cards:
        path = local_path(card)
        rows.append(
            {
                "id": card.id,
                "name": card.name,
                "arch": card.arch,
                "status": "local" if path is not None else "remote",
                "path": str(path) if path else None,
                "native_mtp": card.native_mtp.model_dump() if card.native_mtp else None,
            }
        )
    rows.sort(key=lambda r: r["status"] != "local")
    if args.json:
        print_json(rows)
        return 0
    for row in rows:
        mtp = row["native_mtp"]
        mtp_text = f"MTP k={mtp['default_k']}..{mtp['max_k']}" if mtp else "no MTP head"
        print(f"{row['id']:<36} {row['status']:<7} {row['arch']:<12} {mtp_text}")
    return 0
