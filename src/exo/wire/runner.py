"""The contract between a daemon and its runner processes, beyond the Runner service's messages."""

from __future__ import annotations

# Exit statuses a runner uses to say why it stopped (anything else is a crash, and restartable).
EXIT_LOAD_FAILED = 3  # the checkpoint cannot be loaded: the same command would fail again
EXIT_GROUP_LOST = 4  # a pipeline stage lost a member of its group: the group must be formed anew

# gRPC message size limit of the runner socket, both directions.
MAX_MESSAGE_BYTES = 64 << 20
# A Generate stream sends a heartbeat whenever nothing else flowed for this long.
HEARTBEAT_S = 2.0
