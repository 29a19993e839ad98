"""What the API's dialects share: which dialect a path speaks, its error shape, and message helpers.

exo speaks four dialects over one generation path (``completions.ChatGeneration``): OpenAI chat
completions (``/v1/chat/completions``, ``/v1/completions``), the Anthropic Messages API
(``/v1/messages``, ``anthropic.py``), the OpenAI Responses API (``/v1/responses``, ``responses.py``)
and Ollama's API (``/api/*``, ``ollama.py``). A dialect translates its request into a chat completions
body and the chat answer's parts back into its own wire shape; errors keep their status and take the
dialect's shape (``error_body``), also for failures the middlewares raise (401, 404, 413).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from aiohttp import web

from .errors import APIError

Dialect = Literal["openai", "anthropic", "ollama"]

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def dialect_of(path: str) -> Dialect:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"  # chat completions, completions, responses and exo's own endpoints


def anthropic_error_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(dialect: Dialect, err: APIError) -> dict[str, Any]:
    """An error in the dialect's own shape (the HTTP status is the same in every dialect)."""
    if dialect == "anthropic":
        return {"type": "error", "error": {"type": anthropic_error_type(err.status), "message": err.message}}
    if dialect == "ollama":
        return {"error": err.message}
    return err.body()


# -- strings a client sends ------------------------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


def find_lone_surrogate(value: Any, where: str = "") -> str | None:
    """The dotted path of the first string (or key) in a parsed JSON value holding a lone UTF-16 surrogate
    (``"\\ud800"``: valid JSON, but no Unicode character, so no UTF-8 text can hold it); None if none does.
    A surrogate pair in the JSON (``"\\ud83d\\ude00"``) is already one character: only lone halves remain."""
    if isinstance(value, str):
        return where if _SURROGATE.search(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        path = f"{where}.{key}" if where else str(key)
        if isinstance(key, str) and _SURROGATE.search(key):
            return path
        found = find_lone_surrogate(item, path)
        if found is not None:
            return found
    return None


# -- messages --------------------------------------------------------------------------------------------


def hoist_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """System (and developer) messages joined into one leading system message, the rest in order.

    Agent CLIs send instructions as system-role messages inside the conversation (Claude Code's
    reminders, Codex's developer messages), while the Qwen chat templates accept a system message only at
    the start (they raise otherwise): the instructions keep their order among themselves."""
    system = [m["content"] for m in messages if m["role"] in ("system", "developer") and m["content"]]
    rest = [m for m in messages if m["role"] not in ("system", "developer")]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def arguments_object(arguments: str) -> dict[str, Any] | None:
    """A tool call's arguments (a JSON string) as an object; None when they are not one."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def invalid(param: str | None, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


async def end_stream(response: web.StreamResponse, last: bytes = b"") -> web.StreamResponse:
    """Ends a stream whose headers are sent: ``last`` (a dialect's error events, when the generation
    failed), then EOF; a client that went away meanwhile ends it quietly."""
    try:
        if last:
            await response.write(last)
        await response.write_eof()
    except ConnectionError:
        pass
    return response


async def relay(response: web.StreamResponse, generation: Any, add: Any,
                keepalive: Any, keepalive_s: float) -> None:
    """A dialect's stream body: the first pieces (``keepalive()`` written every ``keepalive_s`` while the
    prompt is read), then every later piece, each translated by ``add`` into the dialect's event bytes."""
    first = await generation.first_keeping_alive(keepalive, keepalive_s)
    await response.write(b"".join(add(p) for p in first))
    while not generation.finished:
        events = b"".join(add(p) for p in await generation.next())
        if events:
            await response.write(events)
