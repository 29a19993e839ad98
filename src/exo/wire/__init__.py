"""The wire: what crosses a process or network boundary, shared by both ends.

- ``proto_gen``: the messages and services generated from ``proto/exo/v1/node.proto`` (the one source
  of truth; ``scripts/gen_proto.py`` derives them);
- ``convert``: engine values (sampling parameters, chunks, stats, typed errors, prompts) to and from
  those messages, so the API node and a runner agree on every field;
- ``runner``: the contract between a daemon and its runner processes (exit codes, limits).

It sits below ``cluster`` (the daemon side) and ``runner`` (the process side) and imports neither.
Importing this package imports nothing else: ``convert`` loads the engine (seconds), which a runner's
Status must not wait for.
"""
