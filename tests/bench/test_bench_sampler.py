"""bench/sampler.py runs and reports both row kinds."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "sampler.py"


def test_sampler_bench_reports_unseeded_and_seeded(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_sampler", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--batch", "3", "--vocab", "700", "--reps", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for kind in ("unseeded", "seeded"):
        assert re.search(rf"^{kind}: \d+\.\d+ ms per call \(3 x 700 bfloat16\)$", out, re.M), out
