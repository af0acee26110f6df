"""The router's OpenAPI document, with every response the API really gives.

FastAPI documents only 200 and its own 422 (which pdserve never sends: validation errors are 400
with an OpenAI error body, router/http/errors.py). This module rewrites the generated document so
that clients and schema-driven tools (schemathesis, tests/router/test_openapi_fuzz.py) see the
truth: each operation lists the error statuses it can answer with the OpenAI error body
``{"error": {"message", "type", "param", "code"}}``; the completion endpoints' 200 may be an SSE
stream (``text/event-stream``); ``/metrics`` is Prometheus text; ``/health``'s 503 has the same
body as its 200.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

_DESCRIPTIONS = {
    400: "Bad request: a field is malformed or out of range (``param`` names it)",
    401: "Missing or wrong API key",
    404: "Unknown model or record",
    409: "Clashes with an operation in progress",
    413: "Request body over the size limit",
    429: "Queue or stream limit reached; retry after ``Retry-After`` seconds",
    431: "Request line and headers over the size limit",
    500: "Workers kept failing for this request",
    503: "Not ready or no worker available; retry after ``Retry-After`` seconds",
    504: "The request's deadline passed",
}
_SERVING = {404, 429, 500, 503, 504}  # what a generation request adds to the input errors
_EXTRA: dict[str, set[int]] = {
    "/v1/chat/completions": _SERVING,
    "/v1/completions": _SERVING,
    "/v1/models": {503},
    "/v1/models/{model_id}": {404, 503},
    "/tokenize": {404},  # an unknown 'model'
    "/detokenize": {404},
    "/v1/requests/{record_id}": {404},
    "/admin/scale": {409, 503},
    "/admin/faults": {404, 503},
}
_STREAMED = ("/v1/chat/completions", "/v1/completions")


# One server-sent event as OpenAPI before 3.2 reads a text/event-stream ``schema`` (each event,
# not the whole stream): its fields per the WHATWG HTML spec, section 9.2 "Server-sent events";
# ``data`` is a JSON chunk or the final ``[DONE]``.
_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def _error_codes(path: str, method: str, documented: dict[str, Any]) -> set[int]:
    codes = {431} | _EXTRA.get(path, set())
    if path.startswith(("/v1/", "/admin/")):
        codes.add(401)  # with --api-key
    if method in ("post", "put", "patch"):
        codes |= {400, 413}
    if "422" in documented:  # FastAPI's validation error: pdserve answers 400
        codes.add(400)
    return codes


def document_responses(schema: dict[str, Any]) -> dict[str, Any]:
    """Rewrite ``schema`` (FastAPI's generated document) in place as the module docstring says."""
    schema.setdefault("components", {}).setdefault("schemas", {})["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        schema["components"]["schemas"].pop(name, None)
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            for code in sorted(_error_codes(path, method, responses)):
                responses[str(code)] = {
                    "description": _DESCRIPTIONS[code],
                    "content": {"application/json": {"schema": ref}},
                }
            responses.pop("422", None)
            if path in _STREAMED:
                responses["200"]["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
    if "/health" in schema.get("paths", {}):
        health = schema["paths"]["/health"]["get"]["responses"]
        health["503"] = {**health["200"], "description": "No decode worker is ready"}
    if "/metrics" in schema.get("paths", {}):
        ok = schema["paths"]["/metrics"]["get"]["responses"]["200"]
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
    return schema


def install_openapi(app: FastAPI) -> None:
    """Serve the rewritten document at ``app.openapi_url`` (built once, on first use)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            app.openapi_schema = document_responses(schema)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
