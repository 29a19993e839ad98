"""Generated from proto/exo/v1/node.proto by scripts/gen_proto.py: do not edit."""
