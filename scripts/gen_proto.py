"""Regenerate the Python stubs of proto/exo/v1/node.proto into src/exo/wire/proto_gen/.

    python scripts/gen_proto.py            # rewrite the committed stubs
    python scripts/gen_proto.py --out DIR  # write them somewhere else (the freshness test does)

Needs grpcio-tools (the dev extra); its version is pinned in pyproject.toml so that everyone derives
the same files. protoc names the message module after the proto's path (exo/v1/node.proto), so the
grpc module's `from exo.v1 import node_pb2` is rewritten to import it from exo.wire.proto_gen.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO_FILE = "exo/v1/node.proto"
PACKAGE = "exo.wire.proto_gen"
DEFAULT_OUT = ROOT / "src" / "exo" / "wire" / "proto_gen"
GENERATED = ("node_pb2.py", "node_pb2.pyi", "node_pb2_grpc.py")
INIT = '"""Generated from proto/exo/v1/node.proto by scripts/gen_proto.py: do not edit."""\n'


def generate(out: Path) -> list[Path]:
    """Write the stubs (and the package's __init__.py) into ``out``; returns the files written."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"  # well-known types shipped with grpcio-tools
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO_FILE),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        written = []
        for name in GENERATED:
            text = (Path(tmp) / "exo" / "v1" / name).read_text()
            if name == "node_pb2_grpc.py":
                old = "from exo.v1 import node_pb2 as exo_dot_v1_dot_node__pb2"
                if old not in text:
                    raise SystemExit(f"unexpected import in the generated {name}: update gen_proto.py")
                text = text.replace(old, f"from {PACKAGE} import node_pb2 as exo_dot_v1_dot_node__pb2")
            (out / name).write_text(text)
            written.append(out / name)
    (out / "__init__.py").write_text(INIT)
    return [out / "__init__.py", *written]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
