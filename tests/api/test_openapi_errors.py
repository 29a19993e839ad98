"""The OpenAPI document's error responses come from the one error table (``exo.wire.errors``): every row a
client can meet at an endpoint is documented at its status, with its code and what it means, and the document
names no code, nor a status for a code, that the table lacks."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import exo.api
from exo.api.downloads import _document as document_downloads
from exo.api.openapi import build_openapi
from exo.wire import errors as we


def _document() -> dict[str, Any]:
    """The whole document a cluster node serves (its downloads' endpoints too)."""
    document = build_openapi(cluster=True)
    document_downloads(document)
    return document


def _documented(document: dict[str, Any]) -> dict[tuple[int, str], set[str]]:
    """(status, code) -> the operations that document it, from each error response's ``x-error-codes``."""
    out: dict[tuple[int, str], set[str]] = {}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            for status, response in operation["responses"].items():
                if int(status) < 400:
                    continue
                assert response.get("x-error-codes"), f"{method} {path} {status}: no codes (written by hand?)"
                for code in response["x-error-codes"]:
                    assert f"`{code}`" in response["description"], (method, path, status, code)
                    out.setdefault((int(status), code), set()).add(f"{method.upper()} {path}")
    return out


def _table() -> set[tuple[int, str]]:
    rows: list[Any] = [*we.ERRORS, we.INTERNAL, *(row for row in we.HTTP_ERRORS if row.endpoint)]
    return {(row.status, code) for row in rows for code in row.codes()}


def test_every_row_of_the_table_is_documented_at_its_status():
    documented = _documented(_document())
    missing = sorted(_table() - set(documented))
    assert missing == [], f"rows of the error table no endpoint documents: {missing}"


def test_the_document_names_no_code_the_table_lacks():
    documented = _documented(_document())
    unknown = {key: sorted(ops) for key, ops in documented.items() if key not in _table()}
    assert unknown == {}, f"(status, code) documented but not in the error table: {unknown}"


def test_every_row_says_what_it_means():
    for row in [*we.ERRORS, we.INTERNAL, *we.HTTP_ERRORS]:
        assert row.about and row.codes(), row


def test_an_error_status_with_retry_after_documents_the_header():
    """The rows that answer with Retry-After (a fixed one, or the exception's own) are those of the statuses
    the document gives the header."""
    document = _document()
    retrying = {row.status for row in we.ERRORS  # QueueFullError carries its own
                if row.retry_after_s is not None or row.exception is we.QueueFullError}
    for item in document["paths"].values():
        for operation in item.values():
            for status, response in operation["responses"].items():
                if int(status) >= 400:
                    assert ("Retry-After" in response.get("headers", {})) == (int(status) in retrying), status


def test_every_code_the_api_raises_by_name_is_a_row():
    """An ``APIError`` raised with a literal code (or the code the server gives aiohttp's own errors) is a row
    of the table: the HTTP layer answers nothing the document cannot name."""
    source = Path(exo.api.__file__).parent
    named: set[str] = set()
    for path in source.glob("*.py"):
        text = path.read_text()
        named.update(re.findall(r'\bcode="([a-z_]+)"', text))
        named.update(re.findall(r'\b\d{3}: "([a-z_]+)"', text) if path.name == "server.py" else ())
        if path.name == "parsing.py":
            # the validation error's code, chosen in a conditional expression line by line
            named.update(re.findall(r'^\s*(?:else )?"([a-z_]+)"$', text, re.MULTILINE))
    assert {"invalid_api_key", "invalid_json", "not_found", "method_not_allowed", "unknown_parameter",
            "missing_required_parameter", "invalid_type"} <= named
    table = {code for row in [*we.ERRORS, *we.HTTP_ERRORS] for code in row.codes()}
    assert named - table == set()
