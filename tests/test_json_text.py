"""JSON text parsed with a bound on nesting (pdserve/json_text.py)."""

from __future__ import annotations

import pytest

from pdserve import json_text

pytestmark = pytest.mark.timeout(30)


def test_nesting_is_bounded_without_recursion() -> None:
    ok = "[" * 100 + "]" * 100
    assert json_text.json_depth(json_text.loads(ok)) == 100
    for deep in ("[" * 101 + "]" * 101, "[" * 5000 + "]" * 5000, '{"a":' * 3000 + "1" + "}" * 3000):
        with pytest.raises(ValueError, match="nested deeper than 100 levels"):
            json_text.loads(deep)
    assert json_text.json_depth({"a": [1, {"b": []}], "c": 2}) == 4
    assert json_text.json_depth(7) == 0
    with pytest.raises(ValueError):
        json_text.loads("{not json")
