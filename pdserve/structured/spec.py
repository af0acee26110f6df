"""What a request's output must match: the structured-output spec (torch-free, engine-free).

The router builds one :class:`StructuredOutputSpec` from whichever request field asked for it
(OpenAI ``response_format``, vLLM's ``structured_outputs`` / ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, or a tool choice that must produce a call); it travels to
the workers as two strings (``kind``, ``value``) and is compiled there by
:mod:`pdserve.structured.grammar`.

Kinds and what ``value`` holds:

* ``json_schema``: a JSON Schema document (JSON text);
* ``json_object``: any JSON object (``value`` is empty);
* ``regex``: a regular expression the whole output must match;
* ``choice``: a JSON array of strings, the output must be exactly one of them;
* ``grammar``: a context-free grammar in GBNF/EBNF (llama.cpp's format, which vLLM users send
  as ``guided_grammar``) or Lark.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Any

from pdserve import json_text

STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# Largest spec text accepted (bytes of ``value``): a bound on compile work and on wire size.
MAX_SPEC_BYTES = 256 * 1024


class StructuredOutputError(ValueError):
    """A structured-output spec is malformed or cannot be compiled.

    ``field`` names the request field the spec came from (e.g. ``response_format``), so the
    gateways can answer 400 naming it.
    """

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One output constraint. ``kind`` is one of :data:`STRUCTURED_KINDS`; ``value`` as in the
    module docstring. ``field``: the request field it came from (for error messages only; not
    part of equality, so the compile cache keys on kind and value).

    Raises StructuredOutputError (naming ``field``) for an unknown kind, a value over
    MAX_SPEC_BYTES, a ``json_schema`` that is not a JSON object, or a ``choice`` that is not a
    non-empty JSON array of strings.
    """

    kind: str
    value: str = ""
    field: str = dc_field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise StructuredOutputError(
                self.field,
                f"unknown structured output kind {self.kind!r}; one of {STRUCTURED_KINDS}",
            )
        if len(self.value.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
            raise StructuredOutputError(
                self.field, f"'{self.field}' is larger than {MAX_SPEC_BYTES} bytes"
            )
        if self.kind == "json_schema":
            try:
                schema = json_text.loads(self.value)
            except ValueError as e:
                raise StructuredOutputError(
                    self.field, f"'{self.field}' schema is not valid JSON: {e}"
                ) from None
            if not isinstance(schema, (dict, bool)):
                raise StructuredOutputError(
                    self.field, f"'{self.field}' schema must be a JSON object"
                )
        elif self.kind == "choice":
            try:
                choices = json_text.loads(self.value)
            except ValueError:
                choices = None
            if (
                not isinstance(choices, list)
                or not choices
                or not all(isinstance(c, str) and c for c in choices)
            ):
                raise StructuredOutputError(
                    self.field, f"'{self.field}' must be a non-empty list of non-empty strings"
                )
        elif self.kind in ("regex", "grammar") and not self.value:
            raise StructuredOutputError(self.field, f"'{self.field}' must not be empty")

    @classmethod
    def json_schema(cls, schema: Any, field: str = "guided_json") -> StructuredOutputSpec:
        """Spec for a schema given as a parsed JSON value (dict) or JSON text.

        NOTE: keys keep their order: the engine emits properties in the schema's order.
        """
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text, field)

    @classmethod
    def choice(cls, choices: list[str], field: str = "guided_choice") -> StructuredOutputSpec:
        """Spec allowing exactly one of ``choices``."""
        return cls("choice", json.dumps(list(choices)), field)
