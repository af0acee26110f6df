"""`pdserve bench sweep`: one workload at several concurrencies or request rates.

Each point is a full `bench serve` run (own warm-up, same prompts and seed) whose result JSON is
saved as ``{label}-c{C}.json`` or ``{label}-r{R}.json``; then ``summary.json`` lists the headline
numbers per point and :func:`pdserve.bench.plot.plot_results` draws the throughput-latency curve.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.bench.datasets import SampleRequest
from pdserve.bench.plot import plot_results
from pdserve.bench.report import format_table, result_to_dict, save_result
from pdserve.bench.serve import BenchConfig, run_benchmark
from pdserve.bench.word_tokenizer import BenchTokenizer

SUMMARY_KEYS = (
    "max_concurrency",
    "request_rate",
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "mean_itl_ms",
    "mean_e2el_ms",
)


def point_filename(label: str, point: dict[str, Any]) -> str:
    """File name of one sweep point: concurrency points ``-c{C}``, rate points ``-r{R}``."""
    if point.get("max_concurrency") and math.isinf(point.get("request_rate", math.inf)):
        return f"{label}-c{point['max_concurrency']}.json"
    return f"{label}-r{point['request_rate']:g}.json"


def run_sweep(
    base: BenchConfig,
    requests: list[SampleRequest],
    tokenizer: BenchTokenizer | None,
    points: Sequence[dict[str, Any]],
    result_dir: Path,
    settings: dict[str, Any] | None = None,
    echo: bool = True,
) -> Path:
    """Run ``base`` once per point (each a dict of BenchConfig fields to override).

    Writes one result JSON per point, ``summary.json`` and the PNG charts into ``result_dir``;
    returns the summary path. Raises BenchmarkError / ValueError like a single run.
    """
    if not points:
        raise ValueError("a sweep needs at least one point")
    result_dir.mkdir(parents=True, exist_ok=True)
    files: list[Path] = []
    rows: list[dict[str, Any]] = []
    for point in points:
        config = replace(base, **point)
        result = asyncio.run(run_benchmark(config, requests, tokenizer))
        if echo:
            print(format_table(result))
        doc = result_to_dict(result, {**(settings or {}), "sweep_point": dict(point)}, False)
        files.append(save_result(doc, result_dir / point_filename(base.label, point)))
        rows.append({k: doc.get(k) for k in SUMMARY_KEYS} | {"file": files[-1].name})
    summary = result_dir / "summary.json"
    summary.write_text(json.dumps({"label": base.label, "points": rows}, indent=2) + "\n")
    plot_results(files, result_dir)
    return summary
