"""Reasoning (``<think>...</think>``) apart from an answer's content, as OpenAI-compatible servers do.

Thinking models (Qwen3, Qwen3.5/3.6) write their reasoning in a ``<think>`` block before the answer; their
chat templates may open that block in the generation prompt, so the output starts with the reasoning and
only its end (``</think>``) is written. Like vLLM's reasoning parsers, exo returns that text as
``reasoning_content`` (``delta.reasoning_content`` when streaming), never as content, and tool calls are
read only from what follows it, so a ``<tool_call>`` the model merely thinks about is not a call.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN = "<think>"
CLOSE = "</think>"


def _partial(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ReasoningSplitter:
    """Feed the generated text piece by piece; each call returns (reasoning, content) ready to send.

    ``opened``: the prompt opened the think block (the output starts inside it)."""

    opened: bool = False
    _state: str = "start"  # start | reasoning | after (the block) | content
    _buffer: str = ""

    def __post_init__(self) -> None:
        if self.opened:
            self._state = "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        if self._state == "start":
            stripped = self._buffer.lstrip()
            if OPEN.startswith(stripped):
                return "", ""  # blanks or a partial tag: wait
            if stripped.startswith(OPEN):
                self._state, self._buffer = "reasoning", stripped[len(OPEN) :]
            else:
                self._state = "content"
        if self._state == "reasoning":
            at = self._buffer.find(CLOSE)
            if at >= 0:
                reasoning, self._buffer = self._buffer[:at], self._buffer[at + len(CLOSE) :]
                self._state = "after"
                return reasoning, self.feed("")[1]
            keep = _partial(self._buffer, CLOSE)
            reasoning = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(reasoning) :]
            return reasoning, ""
        if self._state == "after":  # blanks after the block are dropped
            self._buffer = self._buffer.lstrip()
            if not self._buffer:
                return "", ""
            self._state = "content"
        content, self._buffer = self._buffer, ""
        return "", content

    @property
    def thinking(self) -> bool:
        """Inside the think block (what is fed now is reasoning)."""
        return self._state == "reasoning"

    def finish(self) -> tuple[str, str]:
        rest, self._buffer = self._buffer, ""
        return (rest, "") if self._state == "reasoning" else ("", rest)


def split_whole(text: str, opened: bool = False) -> tuple[str, str]:
    """A whole answer's (reasoning, content), as the same text streamed would give."""
    splitter = ReasoningSplitter(opened=opened)
    reasoning, content = splitter.feed(text)
    more = splitter.finish()
    return reasoning + more[0], content + more[1]
