"""bench/decode_throughput.py: the step table, and the profile of a step with --profile-steps."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "decode_throughput.py"
pytestmark = pytest.mark.timeout(300)


def test_decode_bench_reports_the_step_and_its_profile(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("bench_decode_throughput", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    argv = ["--dtypes", "float32", "--batch-sizes", "2", "--prompt-len", "8", "--no-hf"]
    rc = mod.main([*argv, "--decode-steps", "3", "--repeats", "1", "--profile-steps", "2"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "# profile of 2 decode steps, batch 2" in out
    assert re.search(r"^\s*Name\s+Self CPU %", out, re.M)  # torch.profiler's table header
    assert re.search(
        r"^\| float32 \| 2 \| \d+\.\d \| \d+ \| - \| - \| \d+\.\d \((memory|compute)\) \|$",
        out,
        re.M,
    )
