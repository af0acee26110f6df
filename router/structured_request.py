"""The structured-output and logit fields of an OpenAI/vLLM request -> core values.

One place turns the several ways a client can ask for constrained output into one
:class:`~pdserve.structured.spec.StructuredOutputSpec`:

* OpenAI ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* vLLM's ``structured_outputs`` object (exactly one of ``json`` | ``regex`` | ``choice`` |
  ``grammar`` | ``json_object``) and its older top-level ``guided_json`` / ``guided_regex`` /
  ``guided_choice`` / ``guided_grammar`` fields.

At most one may be given (a 400 names the second). A ``response_format`` without a known
``type``, or a ``structured_outputs`` that sets no constraint, is a 400 too (OpenAI and vLLM
refuse both), never read as "no constraint". ``logit_bias`` keys are token ids as JSON
strings (OpenAI); a key that is not an integer in the vocabulary is a 400 naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pdserve.structured.spec import StructuredOutputError, StructuredOutputSpec
from pdserve.structured.strict import closed_spec
from router.errors import BadRequest

_VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
# the constraint keys of vLLM's StructuredOutputsParams, in its order; exactly one must be set
_VLLM_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# its option keys (vLLM's names), accepted and ignored here: JSON is generated compact, objects
# closed (pdserve/structured/strict.py), and there is one backend
_VLLM_OPTIONS = ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                 "whitespace_pattern")  # fmt: skip
_VLLM_BOOL_OPTIONS = _VLLM_OPTIONS[:3]
_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def top_field(field: str) -> str:
    """The top-level request field of a field path (``structured_outputs.regex`` ->
    ``structured_outputs``): what a "cannot be combined" error names."""
    return field.split(".", 1)[0]


def _spec(kind: str, value: Any, field: str) -> StructuredOutputSpec:
    try:
        if kind == "json_schema":  # closed as vLLM's default backend closes it
            return closed_spec(StructuredOutputSpec.json_schema(value, field))
        if kind == "choice":
            if not isinstance(value, list):
                raise BadRequest(f"'{field}' must be a list of strings", param=field)
            return StructuredOutputSpec.choice(value, field)
        if kind == "json_object":
            return StructuredOutputSpec("json_object", "", field)
        if not isinstance(value, str):
            raise BadRequest(f"'{field}' must be a string", param=field)
        return StructuredOutputSpec(kind, value, field)
    except StructuredOutputError as e:
        raise BadRequest(str(e), param=e.field) from None


def response_format_spec(fmt: Mapping[str, Any] | None) -> StructuredOutputSpec | None:
    """The spec OpenAI's ``response_format`` asks for (None for an absent one or ``text``).

    OpenAI's API reference and vLLM both make ``type`` required: ``text``, ``json_object`` or
    ``json_schema`` (vLLM's ``structural_tag`` is not supported here); a ``json_schema`` needs
    its ``name`` (OpenAI's reference), and its ``schema``, when given, is an object (absent: any
    JSON value). Raises BadRequest naming ``response_format.type`` when it is missing or another
    value, and the ``json_schema`` field at fault.
    """
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("json_object", None, "response_format")
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, Mapping):
            raise BadRequest(
                "'response_format.json_schema' is required with type 'json_schema' (an object: "
                "{'name', 'schema'})",
                param="response_format.json_schema",
            )
        if not isinstance(js.get("name"), str) or not js["name"]:
            raise BadRequest(
                "'response_format.json_schema.name' is required (a non-empty string)",
                param="response_format.json_schema.name",
            )
        if not isinstance(js.get("schema", {}), (Mapping, bool)):
            raise BadRequest(
                "'response_format.json_schema.schema' must be a JSON schema (an object), got "
                f"{type(js['schema']).__name__}",
                param="response_format.json_schema.schema",
            )
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise BadRequest(
                "'response_format.json_schema.strict' must be a boolean, got "
                f"{type(js['strict']).__name__}",
                param="response_format.json_schema.strict",
            )
        return _spec("json_schema", js.get("schema", {}), "response_format.json_schema.schema")
    allowed = ", ".join(repr(k) for k in _RESPONSE_FORMAT_TYPES)
    if kind is None:
        problem = "is required"
    else:
        shown = json.dumps(kind)
        shown = shown if len(shown) <= 40 else f"{shown[:36]}..."
        problem = f"{shown} is not supported"
    raise BadRequest(
        f"'response_format.type' {problem}; it must be one of {allowed}",
        param="response_format.type",
    )


def structured_outputs_spec(so: Mapping[str, Any]) -> StructuredOutputSpec:
    """The spec of vLLM's ``structured_outputs`` object.

    As vLLM's ``StructuredOutputsParams`` does, it must set exactly one constraint: ``json``,
    ``regex``, ``choice``, ``grammar``, ``json_object`` or ``structural_tag`` (null, and
    ``json_object: false``, count as unset). vLLM's option keys beside it
    (``disable_any_whitespace`` ...) are ignored. Raises BadRequest naming
    ``structured_outputs`` when none or several are set or a key is unknown (a misspelt
    constraint would otherwise read as none), and naming the sub-field's path (e.g.
    ``structured_outputs.regex``) when the one set is ``structural_tag`` (not supported here)
    or malformed, or an option has the wrong type (booleans; ``whitespace_pattern`` a string).
    """
    kinds = ", ".join(repr(k) for k in _VLLM_CONSTRAINTS if k != "structural_tag")
    unknown = [k for k in so if k not in _VLLM_CONSTRAINTS and k not in _VLLM_OPTIONS]
    if unknown:
        shown = ", ".join(repr(str(k)[:40]) for k in unknown[:5])
        raise BadRequest(
            f"'structured_outputs' has unknown key(s) {shown}; its constraint is one of {kinds}",
            param="structured_outputs",
        )
    for k in _VLLM_OPTIONS:
        want = bool if k in _VLLM_BOOL_OPTIONS else str
        if so.get(k) is not None and not isinstance(so[k], want):
            raise BadRequest(
                f"'structured_outputs.{k}' must be a {'boolean' if want is bool else 'string'}, "
                f"got {type(so[k]).__name__}",
                param=f"structured_outputs.{k}",
            )
    if so.get("json_object") is not None and not isinstance(so["json_object"], bool):
        raise BadRequest(
            "'structured_outputs.json_object' must be a boolean, got "
            f"{type(so['json_object']).__name__}",
            param="structured_outputs.json_object",
        )
    given = [k for k in _VLLM_CONSTRAINTS if so.get(k) is not None and so.get(k) is not False]
    if not given:
        raise BadRequest(
            f"'structured_outputs' sets no constraint; it must set exactly one of {kinds}",
            param="structured_outputs",
        )
    if len(given) > 1:
        raise BadRequest(
            f"'structured_outputs' sets {len(given)} constraints ({', '.join(given)}); it must "
            f"set exactly one of {kinds}",
            param="structured_outputs",
        )
    k = given[0]
    if k == "structural_tag":
        raise BadRequest(
            "'structured_outputs.structural_tag' is not supported; use 'json', 'regex', "
            "'choice', 'grammar' or 'json_object'",
            param="structured_outputs.structural_tag",
        )
    return _spec(_VLLM_KINDS.get(k, "json_object"), so[k], f"structured_outputs.{k}")


def structured_spec(
    response_format: Mapping[str, Any] | None,
    structured_outputs: Mapping[str, Any] | None,
    guided: Mapping[str, Any],
) -> StructuredOutputSpec | None:
    """The one spec of a request. ``guided``: the ``guided_*`` fields by name (None = absent).
    Raises BadRequest naming the field when one is malformed or two are given."""
    found: list[StructuredOutputSpec] = []
    rf = response_format_spec(response_format)
    if rf is not None:
        found.append(rf)
    if structured_outputs is not None:
        found.append(structured_outputs_spec(structured_outputs))
    for name, value in guided.items():
        if value is not None:
            found.append(_spec(_VLLM_KINDS[name.removeprefix("guided_")], value, name))
    if len(found) > 1:
        second, first = top_field(found[1].field), top_field(found[0].field)
        raise BadRequest(
            f"'{second}' cannot be combined with '{first}': give one output constraint",
            param=second,
        )
    return found[0] if found else None


def logit_bias_pairs(
    bias: Mapping[str, float] | None, vocab_size: int = 2**31
) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs. Raises BadRequest naming a key that is
    not an integer token id in ``[0, vocab_size)`` (the value range is checked by
    SamplingParams; the router checks the model's vocabulary at submit)."""
    out: list[tuple[int, float]] = []
    for key, value in (bias or {}).items():
        # only ASCII digits: int() would also read " 5", "+5", "1_0" and non-ASCII digits as ids
        digits = key.removeprefix("-")
        if not (digits.isascii() and digits.isdigit()):
            raise BadRequest(
                f"'logit_bias' key {json.dumps(key)} is not a token id (an integer as a string, "
                "digits only)",
                param="logit_bias",
            )
        shown = key if len(key) <= 24 else f"{key[:20]}... ({len(key)} characters)"
        if digits != key:
            raise BadRequest(
                f"'logit_bias' key '{shown}' is negative; token ids are >= 0", param="logit_bias"
            )
        # compare lengths first: int() refuses strings of over 4300 digits (a ValueError)
        digits = digits.lstrip("0") or "0"
        if len(digits) > len(str(vocab_size)) or int(digits) >= vocab_size:
            raise BadRequest(
                f"'logit_bias' key '{shown}' is outside the vocabulary [0, {vocab_size})",
                param="logit_bias",
            )
        tid = int(digits)
        out.append((tid, value))
    return tuple(sorted(out))
