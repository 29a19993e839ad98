"""Request bodies: JSON parsing and pydantic validation, failures as OpenAI-style 400s."""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ValidationError

from .dialects import find_lone_surrogate
from .errors import APIError

# A \uD800-\uDFFF escape: the body may hold a lone surrogate (checked on the bytes: most bodies have none).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()  # 413 beyond client_max_size
    if not raw.strip():
        raise APIError(400, "the request body is empty: send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    try:
        where = find_lone_surrogate(body) if _SURROGATE_ESCAPE.search(raw) else None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
    if where is not None:
        # Valid JSON, but no text: a lone surrogate cannot be encoded (the tokenizer, the wire to a runner,
        # a log line would fail on it). Refused here, for every endpoint of every dialect, naming the field.
        raise APIError(
            400,
            f"{where or 'body'}: holds a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), which is "
            "not Unicode text",
            param=where or None,
            code="invalid_value",
        )
    return body


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-plain"}


def _clean_loc(loc: tuple[Any, ...]) -> list[str]:
    # Drop pydantic's union-member tags from a location ("stop.list[str].0" -> "stop.0").
    return [str(p) for p in loc if isinstance(p, int) or ("[" not in p and p not in _TYPE_TAGS)]


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # One field's errors (a union reports one per member); the deepest location is the most useful.
        field_errors = [err for err in errors if err["loc"][:1] == errors[0]["loc"][:1]]
        first = max(field_errors, key=lambda err: len(_clean_loc(err["loc"])))
        param = ".".join(_clean_loc(first["loc"])) or None
        same_field = list(dict.fromkeys(err["msg"] for err in field_errors))[:3]
        kind = first["type"]
        code = (
            "unknown_parameter"
            if kind == "extra_forbidden"
            else "missing_required_parameter"
            if kind == "missing"
            else "invalid_type"
            if kind.endswith("_type") or kind in ("model_attributes_type", "dict_type", "list_type")
            else "invalid_value"
        )
        what = "unknown field" if kind == "extra_forbidden" else "; or ".join(same_field)
        raise APIError(400, f"{param or 'body'}: {what}", param=param, code=code) from None
