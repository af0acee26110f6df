"""The suite's markdown report, rendered from a summary holding issue 15's measured numbers."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.bench.suite.table import fmt_ms, fmt_pair, ratio, render_report

pytestmark = pytest.mark.timeout(60)


def _run(server: str, run: str, client: str = "pdserve", floors: Any = None, **summary: Any):  # type: ignore[no-untyped-def]
    return {"server": server, "run": run, "client": client, "file": f"runs/{server}-{run}.json",
            "summary": summary, "floors": floors}  # fmt: skip


def _floors(duration: float, arith: float, mem: float) -> dict[str, Any]:
    return {"flops": 2.5e13, "bytes_read": 1.4e11, "decode_steps": 508, "arithmetic_s": arith,
            "memory_s": mem, "floor_s": max(arith, mem),
            "bound": "compute" if arith >= mem else "memory", "duration_s": duration,
            "duration_over_floor": duration / max(arith, mem)}  # fmt: skip


def _main(server: str, tput: float, dur: float, p99_tpot: float, **kw: Any) -> dict[str, Any]:
    return _run(server, "main", floors=_floors(dur, 4.0, 2.0), output_throughput=tput,
                duration=dur, mean_ttft_ms=900.0, p99_ttft_ms=2100.0, mean_tpot_ms=250.0,
                p99_tpot_ms=p99_tpot, median_itl_ms=240.0, p99_itl_ms=700.0, **kw)  # fmt: skip


def _short(server: str, run: str, itl: tuple[float, float], ttft: tuple[float, float],
           tpot: float) -> dict[str, Any]:  # fmt: skip
    return _run(server, run, mean_tpot_ms=tpot, median_itl_ms=itl[0], p99_itl_ms=itl[1],
                mean_ttft_ms=ttft[0], p99_ttft_ms=ttft[1], duration=60.0)  # fmt: skip


def summary(with_vllm: bool = True) -> dict[str, Any]:
    """Issue 15's tables as a suite summary."""
    runs = [
        _main("pdserve-disaggregated", 32.4, 253.0, 708.0),
        _main("pdserve-unified", 46.5, 176.0, 406.0),
        _short("pdserve-disaggregated", "short-alone", (149, 241), (1800, 2800), 148),
        _short("pdserve-disaggregated", "short-mixed", (112, 1259), (21000, 47700), 109),
        _run(
            "pdserve-disaggregated",
            "long-mixed",
            completed=15,
            failed=3,
            mean_ttft_ms=30000.0,
            p99_ttft_ms=52000.0,
            mean_e2el_ms=31000.0,
            p99_e2el_ms=53000.0,
        )
        | {"unfinished": 2},  # fmt: skip
        _run("pdserve-disaggregated", "mixed-both-clients", floors=_floors(70, 1, 3)),
    ]
    if with_vllm:
        runs += [
            _main("vllm", 51.7, 159.0, 308.0),
            _short("vllm", "short-alone", (101, 136), (1600, 1900), 102),
            _short("vllm", "short-mixed", (91, 1494), (5500, 17400), 195),
            _main("pdserve-disaggregated", 31.0, 260.0, 700.0) | {"run": "main-vllm-client",
                                                                   "client": "vllm"},
        ]  # fmt: skip
    return {
        "config": {
            "model": "smollm2", "dtype": "float32", "quick": False,
            "main_workload": {"num_prompts": 64, "input_len": 256, "output_len": 128,
                              "max_concurrency": 16, "endpoint": "/v1/chat/completions"},
            "mixed_workload": {"short_num_prompts": 32, "short_input_len": 64,
                               "short_output_len": 128, "short_max_concurrency": 8,
                               "long_input_len": 1500, "long_output_len": 8, "long_rate": 0.25,
                               "endpoint": "/v1/completions"},
        },
        "machine": {
            "dtype": "float32", "threads": 2, "torch_version": "2.13.0",
            "cpu": {"model_name": "AMD EPYC", "logical_cpus": 2,
                    "flags": {"amx_bf16": False, "avx512_bf16": False, "avx2": True}},
            "matmul_n": 1024, "matmul_gflops": {"2": 120.0, "1": 61.0},
            "copy_gbs": {"2": 9.5, "1": 8.0},
            "linears": [{"name": "lm_head", "m": 16, "k": 576, "n": 49152, "threads": 2,
                         "gflops": 140.0}],
            "peak_gflops": 140.0, "peak_copy_gbs": 9.5,
        },
        "git": {"commit": "abc123", "dirty": False},
        "servers": {"pdserve-unified": {"command": ["python", "-m", "pdserve.cli", "serve"]}},
        "runs": runs,
        "plots": {"main": ["plots/main/latency_cdf.png"]},
        "errors": [],
        "elapsed_s": 512.0,
    }  # fmt: skip


def _row(text: str, first_cell: str, section: str = "") -> list[str]:
    """Cells after the first of the row starting ``first_cell``, after heading ``section``."""
    if section:
        text = text[text.index(f"## {section}") :]
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == first_cell:
            return cells[1:]
    raise AssertionError(f"no row {first_cell!r} in:\n{text}")


def test_main_table_side_by_side_with_ratios() -> None:
    text = render_report(summary())
    header = _row(text, "workload")
    assert header == ["vLLM", "pdserve disaggregated", "pdserve unified"]
    tput = _row(text, "main: 256 in / 128 out, 64 prompts, concurrency 16: output tok/s (duration)")
    assert tput == ["51.7 (159 s)", "32.4 (253 s) = 0.63x", "46.5 (176 s) = 0.90x"]
    assert _row(text, "p99 TPOT") == ["308 ms", "708 ms = 2.30x", "406 ms = 1.32x"]
    assert _row(text, "mean / p99 TTFT")[0] == "900 ms / 2.1 s"
    assert _row(text, "floors: arithmetic / memory (bound); duration / floor")[1] == (
        "4.00 / 2.00 s (compute); 63.2x"
    )


def test_mixed_table_shows_starvation() -> None:
    text = render_report(summary())
    header = _row(text, "short requests", "Mixed")
    assert header == ["vLLM alone", "vLLM mixed", "pdserve disaggregated alone",
                      "pdserve disaggregated mixed"]  # fmt: skip
    assert _row(text, "p50 / p99 ITL", "Mixed") == [
        "101 / 136 ms", "91 ms / 1.5 s (11.0x)", "149 / 241 ms", "112 ms / 1.3 s (5.2x)",
    ]  # fmt: skip
    assert _row(text, "mean / p99 TTFT", "Mixed")[-1] == "21.0 / 47.7 s"
    assert _row(text, "long prompts") == [
        "-", "-", "-", "18 sent, 15 completed, 1 failed, 2 cut off unfinished",
    ]  # fmt: skip
    assert _row(text, "long: mean / p99 E2EL")[-1] == "31.0 / 53.0 s"


def test_goals_clients_floors_and_commands() -> None:
    text = render_report(summary())
    assert "- pdserve-disaggregated: main output throughput 0.63x vLLM's (goal >= 2x): not met" in (
        text
    )
    assert "- pdserve-disaggregated: short p99 ITL mixed / alone 5.22x (goal <= 1.5x): not met" in (
        text
    )
    assert "short mean TTFT mixed 21.0 s vs vLLM 5.5 s (goal below): not met" in text
    clients = [line for line in text.splitlines() if line.startswith("| pdserve disaggregated |")]
    assert any("| vllm bench | 31.0 |" in line for line in clients)
    assert any("| pdserve bench | 32.4 |" in line for line in clients)
    floors = _row(text, "pdserve disaggregated", "Floors")  # first floors row: main
    assert floors[:3] == ["main", "253", "25"] and floors[-1] == "63.2x"
    assert "mixed-both-clients" in text
    assert "- pdserve-unified: `python -m pdserve.cli serve`" in text
    assert "[latency_cdf.png](plots/main/latency_cdf.png)" in text
    assert "AMD EPYC, 2 logical CPUs; amx_bf16 no, avx512_bf16 no, avx2 yes" in text


def test_report_without_vllm_has_no_peer_columns_or_goals() -> None:
    text = render_report(summary(with_vllm=False))
    assert _row(text, "workload") == ["pdserve disaggregated", "pdserve unified"]
    assert "Goals" not in text and "Clients compared" not in text
    assert _row(text, "p99 TPOT") == ["708 ms", "406 ms"]  # no ratio without vLLM


def test_formatting_helpers() -> None:
    assert fmt_ms(None) == "-" and fmt_ms(4.21) == "4.2 ms" and fmt_ms(308.4) == "308 ms"
    assert fmt_ms(1600) == "1.6 s"
    assert fmt_pair(101, 136) == "101 / 136 ms" and fmt_pair(1600, 1900) == "1.6 / 1.9 s"
    assert fmt_pair(91, 1494) == "91 ms / 1.5 s" and fmt_pair(None, 3) == "-"
    assert ratio(1, 0) is None and ratio(None, 2) is None and ratio(3, 2) == 1.5
