"""Runners: one subprocess per instance (``python -m exo.runner``), supervised by its node's daemon.

A runner loads one model (or, later, one shard of it as a member of a group joined over
mx.distributed), serves the ``exo.v1.Runner`` gRPC service on a unix socket inside ``$EXO_HOME``
(Status with load progress, Generate) and runs every MLX call on its main thread. Modules: ``main``
(lifecycle), ``service`` (the gRPC service), ``device`` (the generation queue), ``prompt`` (chat
template and context checks), ``wire`` (engine values <-> proto messages).
"""
