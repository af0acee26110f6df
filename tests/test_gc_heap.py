"""freeze_heap: the startup heap moves to the permanent generation once per process."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)

PROBE = """
import gc, time
import torch  # a heap of the size a worker holds (the model's libraries)
from pdserve import gc_heap
garbage = [[i] for i in range(1000)]
garbage.append(garbage)  # a cycle: freed by the collections before the freeze
del garbage
t = time.perf_counter(); gc.collect(2); before = time.perf_counter() - t
assert gc_heap.freeze_heap() is True
assert gc_heap.freeze_heap() is False  # once per process
assert gc.get_freeze_count() > 50000
t = time.perf_counter(); gc.collect(2); after = time.perf_counter() - t
print(before, after)
"""


def test_a_frozen_heap_makes_full_collections_cheap() -> None:
    """In a fresh process (freezing the test runner's heap would keep it for good)."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=50, check=True
    )
    before, after = map(float, out.stdout.split())
    assert after < before / 5, (before, after)
    assert gc.isenabled()
