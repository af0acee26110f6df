"""bench/kv_placement.py: the placement simulation and the three table layouts it times."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kv_placement.py"
pytestmark = pytest.mark.timeout(120)


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_kv_placement", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_placement_keeps_tables_in_runs_as_the_pool_ages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    mod = _load()
    assert mod.main(["--requests", "40,300", "--num-blocks", "1200", "--no-step"]) == 0
    rows = dict(re.findall(r"^\| (\d+) \| ([\d.]+)% \|$", capsys.readouterr().out, re.M))
    assert set(rows) == {"40", "300"}
    assert float(rows["40"]) == 100.0  # a fresh pool: every table one run
    assert float(rows["300"]) > 35.0  # cycled through the LRU list (44%; the old placement 17.5%)


def test_layouts_are_disjoint_and_keep_the_allocator_ids() -> None:
    mod = _load()
    args = mod.parse_args(["--requests", "50", "--num-blocks", "600", "--concurrency", "4"])
    _, tables = mod.place(args, 50)
    assert len(tables) == 4
    by, size = mod.layouts(tables, 600, 0)
    n = sum(len(t) for t, _ in tables)
    assert size == 2 * n + 600
    flat = {name: [b for t in ts for b in t] for name, ts in by.items()}
    assert flat["contiguous"] == list(range(n))
    assert [b - n for b in flat["allocator"]] == [b for t, _ in tables for b in t]
    assert sorted(flat["shuffled"]) == list(range(n + 600, 2 * n + 600))
    assert set(flat["contiguous"]).isdisjoint(flat["allocator"])
    assert set(flat["allocator"]).isdisjoint(flat["shuffled"])
    for (table, ctx), placed in zip(tables, by["allocator"], strict=True):
        assert len(placed) == len(table) and ctx <= 16 * len(table)
