"""bench/attention.py: refuses without a GPU, and its kernel check passes under the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).parents[2] / "bench" / "attention.py"


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(SCRIPT.parents[1])
    return subprocess.run(
        [sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=170
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_refuses_without_cuda() -> None:
    proc = _run()
    assert proc.returncode == 2
    assert "no CUDA device" in proc.stderr and "--interpret" in proc.stderr


def test_interpreted_check_passes() -> None:
    proc = _run("--interpret")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("decode ", "decode split-K", "extend", "kv write"):
        assert name in proc.stdout
    assert "FAIL" not in proc.stdout
