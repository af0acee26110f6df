"""Static bounds on what a structured-output spec may ask of the grammar engine.

llguidance bounds compile work (lexer fuel, grammar size) but not the per-token cost of a lexeme
whose regex is long once counted repetitions are expanded: ``a{1000000}`` compiles in 2 ms and
then costs ~300 ms per mask (a{10000}: ~2 ms), inside the decode worker's step loop, so every
other sequence in the batch waits. Likewise a ``choice`` list longer than the Earley parser's
row limit (``max_items_in_row``, 2000) compiles and only fails at the first token, after a full
prefill, and an object schema with thousands of optional properties costs seconds to compile and
~100 ms per mask. :func:`check_spec_limits` refuses such specs up front, naming the field and the
limit (in the spirit of vLLM's per-request limits); the router calls it through the compiler, so
a client gets a 400 before any worker sees the request.

Measured on SmolLM2's 49k vocabulary (one core): per-mask cost grows linearly with the expanded
regex size; at :data:`MAX_REGEX_SIZE` it is ~2 ms, well under one decode step.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pdserve.structured.finite import has_finite_instance
from pdserve.structured.spec import StructuredOutputError, StructuredOutputSpec

# Atoms of one regex with counted repetitions expanded (``(ab){100}`` = 200; a character
# class is one atom; ``*`` / ``+`` / ``?`` do not multiply).
MAX_REGEX_SIZE = 10_000
# Entries of a ``choice`` list (below llguidance's 2000-item Earley row limit).
MAX_CHOICES = 1000
# Property definitions (``properties`` entries) in one JSON schema, all objects together.
MAX_SCHEMA_PROPERTIES = 1000

_COUNTED = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LARK_RANGE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_LARK_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/[imslux]*")


def _class_end(pattern: str, i: int) -> int:
    """Index just past the character class that opens at ``pattern[i] == '['``."""
    depth = 0
    j = i
    while j < len(pattern):
        c = pattern[j]
        if c == "\\":
            j += 2
            continue
        if c == "[":
            depth += 1
            j += 1
            if j < len(pattern) and pattern[j] == "^":
                j += 1
            if j < len(pattern) and pattern[j] == "]":  # a literal ']' first in the class
                j += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return len(pattern)


def regex_size(pattern: str) -> int:
    """Atoms of ``pattern`` once counted repetitions (``{m}``, ``{m,}``, ``{m,n}``) are expanded,
    alternatives summed. A conservative measure of the automaton llguidance's derivative-based
    lexer walks per token; the syntax is Rust ``regex``'s (a superset of what we need here)."""
    stack: list[list[int]] = [[]]  # item sizes of each open group
    i = 0
    n = len(pattern)
    while i < n:
        c = pattern[i]
        items = stack[-1]
        if c == "\\":
            j = i + 2
            if i + 1 < n and pattern[i + 1] in "pPxuU" and j < n and pattern[j] == "{":
                j = pattern.find("}", j) + 1 or n
            items.append(1)
            i = j
        elif c == "[":
            items.append(1)
            i = _class_end(pattern, i)
        elif c == "(":
            stack.append([])
            i += 1
        elif c == ")":
            if len(stack) > 1:
                inner = sum(stack.pop())
                stack[-1].append(inner)
            i += 1
        elif c == "{" and (m := _COUNTED.match(pattern, i)) is not None:
            low = int(m.group(1))
            high = int(m.group(2)) if m.group(2) else low
            if items:
                items[-1] *= max(low, high)
            i = m.end()
        elif c in "|*+?":
            i += 1
        else:
            items.append(1)
            i += 1
    while len(stack) > 1:  # unbalanced: let the engine report the syntax error
        inner = sum(stack.pop())
        stack[-1].append(inner)
    return sum(stack[0])


def _check_regex(pattern: str, field: str, where: str) -> None:
    size = regex_size(pattern)
    if size > MAX_REGEX_SIZE:
        raise StructuredOutputError(
            field,
            f"'{field}': {where} is too large once its counted repetitions are expanded "
            f"({size} atoms; the limit is {MAX_REGEX_SIZE}): use smaller {{m,n}} counts",
        )


def _walk_schema(node: Any, field: str, counts: list[int]) -> None:
    if isinstance(node, list):
        for item in node:
            _walk_schema(item, field, counts)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key == "pattern" and isinstance(value, str):
            _check_regex(value, field, "a schema 'pattern'")
        elif key == "patternProperties" and isinstance(value, dict):
            for pat in value:
                _check_regex(pat, field, "a schema 'patternProperties' key")
        if key == "properties" and isinstance(value, dict):
            counts[0] += len(value)
        if key not in ("enum", "const", "default", "examples"):
            _walk_schema(value, field, counts)


def _check_grammar(text: str, field: str) -> None:
    body = _STRING.sub('""', text)  # quoted literals may hold braces and slashes
    for m in _LARK_REGEX.finditer(body):
        _check_regex(m.group(1), field, f"the regex /{m.group(1)[:40]}/")
    body = _LARK_REGEX.sub("//", body)
    for m in (*_COUNTED.finditer(body), *_LARK_RANGE.finditer(body)):
        count = max(int(m.group(1)), int(m.group(2) or 0))
        if count > MAX_REGEX_SIZE:
            raise StructuredOutputError(
                field,
                f"'{field}': the repetition {m.group(0).strip()} repeats {count} times; "
                f"the limit is {MAX_REGEX_SIZE}",
            )


def check_spec_limits(spec: StructuredOutputSpec) -> None:
    """Raise StructuredOutputError naming ``spec.field`` and the limit when ``spec`` exceeds
    :data:`MAX_REGEX_SIZE`, :data:`MAX_CHOICES` or :data:`MAX_SCHEMA_PROPERTIES`, or names
    the fault when a JSON schema admits no finite value
    (:func:`~pdserve.structured.finite.has_finite_instance`)."""
    field = spec.field
    if spec.kind == "regex":
        _check_regex(spec.value, field, "the regex")
    elif spec.kind == "choice":
        num = len(json.loads(spec.value))
        if num > MAX_CHOICES:
            raise StructuredOutputError(
                field, f"'{field}' has {num} choices; at most {MAX_CHOICES} are allowed"
            )
    elif spec.kind == "json_schema":
        counts = [0]
        schema = json.loads(spec.value)
        _walk_schema(schema, field, counts)
        if counts[0] > MAX_SCHEMA_PROPERTIES:
            raise StructuredOutputError(
                field,
                f"'{field}' schema defines {counts[0]} properties; at most "
                f"{MAX_SCHEMA_PROPERTIES} are allowed",
            )
        if not has_finite_instance(schema):
            raise StructuredOutputError(
                field,
                f"'{field}': no finite JSON value matches the schema (a value it requires "
                "contains itself without end, e.g. a required property whose schema refers "
                "back to its own object, or is refused outright)",
            )
    elif spec.kind == "grammar":
        _check_grammar(spec.value, field)
