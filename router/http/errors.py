"""HTTP error handlers: every error is ``{"error": {"message", "type", "param", "code"}}``.

400 for bad input (also what FastAPI would report as 422, phrased for API users and naming the
field), 401, 404, 429 with ``Retry-After``, 500 (an unexpected exception, logged), 503, 504.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import metrics
from router.errors import BadRequest, RouterError

log = logging.getLogger(__name__)

# pydantic union-member tags that appear in an error location but name no field
_UNION_TAGS = ("str", "int", "float", "bool", "list", "dict", "none")


def error_response(err: RouterError) -> JSONResponse:
    """The OpenAI-shaped JSON error for ``err`` (with Retry-After when set)."""
    metrics.REQUEST_ERRORS.labels(code=str(err.status)).inc()
    headers = {"Retry-After": str(err.retry_after_s)} if err.retry_after_s else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for the first pydantic error, phrased for API users."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    if e.get("type") == "json_invalid":
        detail = (e.get("ctx") or {}).get("error", "")
        return f"the request body is not valid JSON: {detail}".rstrip(": "), None
    loc = [p for p in e.get("loc", ()) if p != "body"]
    if not loc and e.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        return (
            "the request body must be a JSON object (send it with "
            "'Content-Type: application/json')",
            None,
        )
    parts = _field_path(loc)
    param = ".".join(parts) or None
    if e.get("type") == "missing":
        return (f"'{param}' is required" if param else "the request body is required"), param
    got = e.get("input")
    shown = "" if isinstance(got, (dict, list, bytes)) else f" (got {_short_repr(got)})"
    # a union field (e.g. stop: str | list[str]): pydantic reports one error per member
    members = [
        x for x in errors if _field_path(_body_loc(x)) == parts and len(_body_loc(x)) > len(parts)
    ]
    nested = [x for x in members if len(_body_loc(x)) > len(parts) + 1]
    if nested:  # the value had a member's shape; an element is wrong: name the deepest such one
        x = max(nested, key=lambda y: len(_body_loc(y)))
        where = ".".join([*parts, *(str(q) for q in _body_loc(x)[len(parts) + 1 :])])
        val = x.get("input")
        shown = "" if isinstance(val, (dict, list, bytes)) else f" (got {_short_repr(val)})"
        return f"'{where}': {x.get('msg', 'invalid value')}{shown}", param
    tags = [str(_body_loc(x)[len(parts)]) for x in members]
    if len(tags) > 1:
        kinds = list(dict.fromkeys(_json_kind(t) for t in tags))
        said = kinds[0] if len(kinds) == 1 else ", ".join(kinds[:-1]) + " or " + kinds[-1]
        return f"'{param}' must be {said}{shown}", param
    return f"'{param}': {e.get('msg', 'invalid value')}{shown}", param


def _body_loc(err: Any) -> list[Any]:
    return [p for p in err.get("loc", ()) if p != "body"]


def _field_path(loc: list[Any]) -> list[str]:
    """The field names of an error location, up to a pydantic union-member tag."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and ("[" in p or p in _UNION_TAGS):
            break  # a pydantic union-member tag, not a field
        parts.append(str(p))
    return parts


_KINDS = {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean",
          "none": "null", "dict": "an object"}  # fmt: skip


def _json_kind(tag: str) -> str:
    """A union-member tag (``str``, ``list[str]``, ``list[list[int]]``) in JSON words."""
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _json_kind(tag[5:-1]).split(" ", 1)[-1]  # without its article
        if inner.startswith("array of "):  # plural of "array of X" is "arrays of X"
            return f"an array of arrays of {inner.removeprefix('array of ')}"
        return f"an array of {inner}s"
    if tag.startswith("dict["):
        return "an object"
    return _KINDS.get(tag, tag)


def _short_repr(value: object, limit: int = 64) -> str:
    """``repr(value)`` cut to ``limit`` characters: errors never echo a large input back."""
    r = repr(value)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Route every error ``app`` can raise through :func:`error_response`."""

    @app.exception_handler(RouterError)
    async def on_router_error(_request: Request, exc: RouterError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(BadRequest(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = str(exc.detail)
        cause = exc.__cause__
        if exc.status_code == 400 and cause is not None:
            # FastAPI's "There was an error parsing the body" hides why (bytes that are not
            # UTF-8, an integer past Python's 4300-digit limit, nesting deeper than the parser
            # recurses): say it
            detail = f"the request body could not be parsed: {_short_repr(str(cause), 160)}"
        err = RouterError(detail)
        err.status = exc.status_code
        err.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(err)

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error", exc_info=exc)
        return error_response(RouterError(f"internal server error: {type(exc).__name__}"))
