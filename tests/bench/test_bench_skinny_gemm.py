"""bench/skinny_gemm.py runs and reports every shape, or says why the kernel cannot run here."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from pdserve.model.cpu_linear import skinny_reason

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "skinny_gemm.py"
pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_skinny_gemm_bench_reports_each_shape(
    dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("bench_skinny_gemm", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--rows", "5", "--layers", "1", "--rounds", "1", "--dtype", dtype])
    captured = capsys.readouterr()
    if skinny_reason(getattr(torch, dtype)) is not None:  # e.g. AVX2 only: it says so and fails
        assert rc == 2 and "unavailable" in captured.err
        return
    assert rc == 0
    for name in mod.SHAPES:
        assert re.search(
            rf"^{name} .*skinny +\d+\.\d+ ms .*oneDNN +\d+\.\d+ ms", captured.out, re.M
        )
    assert re.search(
        r"^total: skinny \d+\.\d+ ms, oneDNN \d+\.\d+ ms = \d+\.\d+x$", captured.out, re.M
    )


def test_skinny_gemm_bench_times_gguf_codes(capsys: pytest.CaptureFixture[str]) -> None:
    """--gguf-codes: every shape timed three ways, the coded and fp32 panels checked bit-equal;
    where the codes are not built (no AVX-512F) it says so and fails."""
    spec = importlib.util.spec_from_file_location("bench_skinny_gemm_codes", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rc = mod.main(["--rows", "3", "--layers", "1", "--rounds", "1", "--gguf-codes"])
    captured = capsys.readouterr()
    if rc == 2:
        assert "unavailable" in captured.err and "AVX-512F" in captured.err
        return
    assert rc == 0
    for name in mod.SHAPES:
        assert re.search(
            rf"^{name} .*(Q4_1|Q8_0) +codes +\d+\.\d+ ms +fp32 panels +\d+\.\d+ ms +oneDNN",
            captured.out,
            re.M,
        )
    assert re.search(r"fp32 panels / codes = \d+\.\d+x$", captured.out, re.M)
