"""Result JSON validation, `bench sweep` and `bench plot` (PNG charts)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import start_fake_server

from pdserve.bench.report import ResultValidationError, default_filename, validate_result
from pdserve.cli import main

pytestmark = pytest.mark.timeout(180)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CHARTS = ("latency_cdf.png", "throughput_vs_concurrency.png", "throughput_latency.png")


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One sweep (concurrency 1 and 3) against a fake server, shared by this module's tests."""
    tmp = tmp_path_factory.mktemp("sweep")
    server = start_fake_server({"default": {"ttft_ms": 10, "itl_ms": [3, 3, 3]}}, tmp / "s.json")
    out = tmp / "sweep"
    try:
        rc = main([
            "bench", "sweep", "--base-url", server.base_url, "--model", "fake-model",
            "--tokenizer", "builtin", "--num-prompts", "6", "--random-input-len", "8",
            "--random-output-len", "4", "--max-concurrency-list", "1,3", "--disable-tqdm",
            "--label", "fake", "--result-dir", str(out),
        ])  # fmt: skip
    finally:
        server.stop()
    assert rc == 0
    yield out


def test_sweep_writes_runs_summary_and_charts(sweep_dir: Path) -> None:
    summary = json.loads((sweep_dir / "summary.json").read_text())
    assert [p["max_concurrency"] for p in summary["points"]] == [1, 3]
    assert all(p["completed"] == 6 and p["failed"] == 0 for p in summary["points"])
    for name in ("fake-c1.json", "fake-c3.json"):
        doc = json.loads((sweep_dir / name).read_text())
        validate_result(doc)
        assert "generated_texts" not in doc
    c1 = json.loads((sweep_dir / "fake-c1.json").read_text())
    assert c1["max_concurrent_requests"] == 1
    for chart in CHARTS:
        data = (sweep_dir / chart).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000


def test_plot_mixes_our_files_and_vllm_files(
    sweep_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ours = json.loads((sweep_dir / "fake-c3.json").read_text())
    # A vLLM result file: per-request arrays with vLLM's key names, no schema/labels.
    vllm = {k: ours[k] for k in ("ttfts", "itls", "latencies", "output_lens", "errors",
                                 "output_throughput", "max_concurrency")}  # fmt: skip
    vllm["backend"] = "vllm"
    vpath = tmp_path / "vllm.json"
    vpath.write_text(json.dumps(vllm))
    out = tmp_path / "charts"
    rc = main(
        ["bench", "plot", str(sweep_dir / "fake-c1.json"), str(vpath), "--output-dir", str(out)]
    )
    assert rc == 0
    assert capsys.readouterr().out.split() == [str(out / c) for c in CHARTS]
    assert all((out / c).read_bytes().startswith(PNG_MAGIC) for c in CHARTS)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ttfts": [1.0], "itls": []}))
    assert main(["bench", "plot", str(bad), "--output-dir", str(out)]) == 2
    assert "per-request arrays missing or uneven" in capsys.readouterr().err


def test_validate_result_names_the_bad_field(sweep_dir: Path) -> None:
    good = json.loads((sweep_dir / "fake-c1.json").read_text())
    validate_result(good)
    assert default_filename(good).startswith("fake-infqps-concurrency1-fake-model-")

    def broken(**changes: Any) -> dict[str, Any]:
        doc = copy.deepcopy(good)
        for k, v in changes.items():
            if v is None:
                del doc[k]
            else:
                doc[k] = v
        return doc

    cases = [
        (broken(schema="x"), "'schema'"),
        (broken(duration=None), "missing field 'duration'"),
        (broken(completed="6"), "field 'completed' has type str"),
        (broken(failed=1), "completed (6) + failed (1) != num_prompts (6)"),
        (broken(ttfts=good["ttfts"][:-1]), "'ttfts' must be a list of 6"),
        (broken(latencies=[-1.0] * 6), "latencies[0]"),
        (broken(errors=["boom"] + [""] * 5), "5 requests without error but completed = 6"),
        (broken(p99_tpot_ms=None), "'p99_tpot_ms'"),
        (broken(good_completed=7), "'good_completed'"),
    ]
    for doc, msg in cases:
        with pytest.raises(ResultValidationError, match=None) as e:
            validate_result(doc)
        assert msg in str(e.value), (msg, str(e.value))
    with pytest.raises(ResultValidationError, match="JSON object"):
        validate_result([good])
