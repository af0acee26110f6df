"""bench/cpu_attention.py: a tiny run checks the kernel against torch_ref and prints its table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).parents[2] / "bench" / "cpu_attention.py"


def test_tiny_table() -> None:
    argv = ["--batch-sizes", "1,3", "--contexts", "17,40", "--threads", "1", "--repeats", "1"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=170
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| ") and "ms" not in ln]
    assert len(rows) == 2 * 1 * 2 * 2  # dtypes x threads x batch sizes x contexts
    assert "FAIL" not in proc.stdout
