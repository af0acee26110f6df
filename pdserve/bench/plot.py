"""PNG charts from benchmark result files (ours or ``vllm bench serve --save-result`` files).

Charts (matplotlib, Agg backend, no display needed):

- ``latency_cdf.png``: cumulative distributions of TTFT, TPOT, ITL and E2EL, one line per file;
- ``throughput_vs_concurrency.png``: output tokens/s and mean TTFT / TPOT against the run's
  concurrency cap (or, for uncapped runs, the peak number of requests in flight), one line per
  label;
- ``throughput_latency.png``: the throughput-latency curve (median TPOT and mean TTFT against
  output tokens/s), one line per label, points annotated with their concurrency or rate.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)
import numpy as np  # noqa: E402

from pdserve.bench.report import (  # noqa: E402
    SCHEMA,
    ResultValidationError,
    per_request_tpots,
    validate_result,
)


@dataclass(frozen=True)
class PlotRun:
    """What the charts need from one result file. Latency lists in seconds."""

    path: Path
    label: str
    max_concurrency: int | None
    request_rate: float
    peak_concurrency: int
    output_throughput: float
    ttfts: list[float]
    tpots: list[float]
    itls: list[float]
    e2els: list[float]

    @property
    def x_concurrency(self) -> int:
        """Concurrency to plot: the cap, else the peak measured in flight."""
        return self.max_concurrency or self.peak_concurrency

    @property
    def point_name(self) -> str:
        """'c=8' for a concurrency cap, 'r=2' for a finite rate, else the peak in flight."""
        if self.max_concurrency:
            return f"c={self.max_concurrency}"
        if math.isfinite(self.request_rate):
            return f"r={self.request_rate:g}"
        return f"peak={self.peak_concurrency}"


def load_run(path: Path) -> PlotRun:
    """Read one result file. Our files are fully validated; other files (vLLM) need the
    per-request arrays ``ttfts``, ``itls``, ``latencies``, ``output_lens`` and ``errors``.

    Raises ResultValidationError naming the file and field.
    """
    try:
        doc: Any = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultValidationError(f"{path}: cannot read result JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ResultValidationError(f"{path}: result must be a JSON object")
    try:
        if doc.get("schema") == SCHEMA:
            validate_result(doc)
        else:
            lens = {k: len(doc.get(k) or []) for k in
                    ("ttfts", "itls", "latencies", "output_lens", "errors")}  # fmt: skip
            if len(set(lens.values())) != 1 or not next(iter(lens.values())):
                raise ResultValidationError(f"per-request arrays missing or uneven: {lens}")
    except ResultValidationError as e:
        raise ResultValidationError(f"{path}: {e}") from None
    ok = [not e for e in doc["errors"]]
    rate = doc.get("request_rate", "inf")
    return PlotRun(
        path=path,
        label=str(doc.get("label") or doc.get("backend") or path.stem),
        max_concurrency=doc.get("max_concurrency"),
        request_rate=float(rate) if rate is not None else math.inf,
        peak_concurrency=int(doc.get("max_concurrent_requests") or sum(ok)),
        output_throughput=float(doc.get("output_throughput") or 0.0),
        ttfts=[t for t, good in zip(doc["ttfts"], ok, strict=True) if good],
        tpots=per_request_tpots(doc),
        itls=[g for gaps, good in zip(doc["itls"], ok, strict=True) if good for g in gaps],
        e2els=[t for t, good in zip(doc["latencies"], ok, strict=True) if good],
    )


def _cdf(ax: Any, values_s: Sequence[float], label: str) -> None:
    if not values_s:
        return
    xs = np.sort(np.asarray(values_s) * 1000.0)
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post", label=label)


def plot_latency_cdf(runs: Sequence[PlotRun], out: Path) -> Path:
    """Write the 2x2 latency CDF chart to ``out``; returns it."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (title, attr) in zip(
        axes.flat,
        (("TTFT", "ttfts"), ("TPOT", "tpots"), ("ITL", "itls"), ("E2EL", "e2els")),
        strict=True,
    ):
        for run in runs:
            _cdf(ax, getattr(run, attr), f"{run.label} {run.point_name}")
        ax.set_title(f"{title} CDF")
        ax.set_xlabel(f"{title} (ms)")
        ax.set_ylabel("fraction of requests" if attr != "itls" else "fraction of gaps")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _by_label(runs: Sequence[PlotRun]) -> dict[str, list[PlotRun]]:
    groups: dict[str, list[PlotRun]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    return groups


def plot_throughput_vs_concurrency(runs: Sequence[PlotRun], out: Path) -> Path:
    """Output tokens/s and mean TTFT/TPOT against concurrency, one line per label."""
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, group in _by_label(runs).items():
        group = sorted(group, key=lambda r: r.x_concurrency)
        xs = [r.x_concurrency for r in group]
        ax_t.plot(xs, [r.output_throughput for r in group], "o-", label=label)
        ax_l.plot(xs, [1000 * float(np.mean(r.ttfts or [0])) for r in group], "o-",
                  label=f"{label} mean TTFT")  # fmt: skip
        ax_l.plot(xs, [1000 * float(np.mean(r.tpots or [0])) for r in group], "s--",
                  label=f"{label} mean TPOT")  # fmt: skip
    ax_t.set_title("Output throughput vs concurrency")
    ax_t.set_xlabel("max concurrency (peak in flight if uncapped)")
    ax_t.set_ylabel("output tokens/s")
    ax_l.set_title("Latency vs concurrency")
    ax_l.set_xlabel("max concurrency (peak in flight if uncapped)")
    ax_l.set_ylabel("ms")
    ax_l.set_yscale("log")
    for ax in (ax_t, ax_l):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_throughput_latency(runs: Sequence[PlotRun], out: Path) -> Path:
    """Median TPOT and mean TTFT against output tokens/s, one line per label."""
    fig, (ax_p, ax_f) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, group in _by_label(runs).items():
        group = sorted(group, key=lambda r: r.output_throughput)
        xs = [r.output_throughput for r in group]
        tpot = [1000 * float(np.median(r.tpots or [0])) for r in group]
        ttft = [1000 * float(np.mean(r.ttfts or [0])) for r in group]
        ax_p.plot(xs, tpot, "o-", label=label)
        ax_f.plot(xs, ttft, "o-", label=label)
        for r, x, y1, y2 in zip(group, xs, tpot, ttft, strict=True):
            ax_p.annotate(
                r.point_name, (x, y1), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
            ax_f.annotate(
                r.point_name, (x, y2), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    ax_p.set_title("Median TPOT vs output throughput")
    ax_p.set_ylabel("median TPOT (ms)")
    ax_f.set_title("Mean TTFT vs output throughput")
    ax_f.set_ylabel("mean TTFT (ms)")
    for ax in (ax_p, ax_f):
        ax.set_xlabel("output tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_results(paths: Sequence[Path], output_dir: Path) -> list[Path]:
    """Read result files and write the three charts into ``output_dir``; returns their paths.

    Raises ResultValidationError for an unreadable or invalid file, ValueError for no files.
    """
    if not paths:
        raise ValueError("give at least one result file")
    runs = [load_run(Path(p)) for p in paths]
    output_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_latency_cdf(runs, output_dir / "latency_cdf.png"),
        plot_throughput_vs_concurrency(runs, output_dir / "throughput_vs_concurrency.png"),
        plot_throughput_latency(runs, output_dir / "throughput_latency.png"),
    ]
