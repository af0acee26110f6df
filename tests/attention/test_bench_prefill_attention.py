"""bench/prefill_attention.py: a tiny run against the current revision's own kernel prints one
row per dtype and chunk, each output within the dtype's error of the definition."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).parents[2] / "bench" / "prefill_attention.py"


def test_tiny_table_against_head() -> None:
    argv = ["--prompt-len", "40", "--cached", "17", "--chunk", "9", "--repeats", "1"]
    argv += ["--baseline-rev", "HEAD"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln.split("|")[1:-1] for ln in proc.stdout.splitlines() if ln.startswith("| ")]
    rows = [r for r in rows if "ms" not in r[2]]  # the header
    assert len(rows) == 2 * 2  # dtypes x chunks
    for dtype, _, _, err, _, base_err in rows:
        bound = 1e-2 if "bfloat16" in dtype else 1e-5
        assert float(err) < bound and float(base_err) < bound, rows
