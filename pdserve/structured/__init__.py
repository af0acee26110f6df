"""Structured output: output constrained by a JSON schema, regex, choice list or grammar.

:mod:`~pdserve.structured.spec` (what to match; torch- and engine-free, the router builds it) and
:mod:`~pdserve.structured.grammar` (compile once per spec, per-sequence matchers, token bitmasks).
"""

from pdserve.structured.spec import (
    MAX_SPEC_BYTES,
    STRUCTURED_KINDS,
    StructuredOutputError,
    StructuredOutputSpec,
)

__all__ = ["MAX_SPEC_BYTES", "STRUCTURED_KINDS", "StructuredOutputError", "StructuredOutputSpec"]
