"""The items of a generation stream besides the engine's chunks, as the API receives them wherever the model
runs (in this process, on this node's runner, on another node: there rebuilt from ``GenerateChunk.started``
and ``GenerateChunk.error``): ``Started`` first, then chunks, or ``Failed`` at any point."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Started:
    """The first item of a generation: it passed validation and the device is on it."""

    prompt_tokens: int
    max_tokens: int
    queue_s: float
    thinking: bool = False  # the prompt opened a think block: the output starts with reasoning


@dataclass(frozen=True)
class Failed:
    error: BaseException
