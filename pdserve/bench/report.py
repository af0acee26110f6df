"""Benchmark output: the results table, the ``--save-result`` JSON and its validator.

The JSON uses the key names of ``vllm bench serve`` result files (``mean_ttft_ms``,
``p99_tpot_ms``, ``output_throughput``, ``ttfts``, ``itls`` ...) so files from both tools can be
compared and plotted together, plus ``schema`` / ``settings`` / ``labels`` / ``failed``.
Per-request arrays are in request order, seconds for times; failed requests keep their slot
(zeros and an ``errors`` entry).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import (
    METRIC_NAMES,
    BenchmarkMetrics,
    RequestOutput,
    calculate_metrics,
    percentile_key,
)
from pdserve.bench.serve import BenchmarkResult

SCHEMA = "pdserve.bench.serve/v1"
WIDTH = 50
_HEADERS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def _row(name: str, value: Any) -> str:
    text = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{name:<40} {text:<10}"


def format_table(result: BenchmarkResult) -> str:
    """The results table in the layout of ``vllm bench serve`` (mean, median, percentiles)."""
    m, cfg = result.metrics, result.config
    lines = ["{:=^{w}}".format(" Serving Benchmark Result ", w=WIDTH)]
    lines.append(_row("Successful requests:", m.completed))
    lines.append(_row("Failed requests:", m.failed))
    if cfg.max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", cfg.max_concurrency))
    if not math.isinf(cfg.request_rate) and not result.self_timed:
        lines.append(_row("Request rate configured (RPS):", float(cfg.request_rate)))
    lines.append(_row("Benchmark duration (s):", m.duration_s))
    lines.append(_row("Total input tokens:", m.total_input))
    lines.append(_row("Total generated tokens:", m.total_output))
    lines.append(_row("Request throughput (req/s):", m.request_throughput))
    if m.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", m.request_goodput))
        lines.append(_row("Requests meeting all SLOs:", m.good_completed))
    lines.append(_row("Output token throughput (tok/s):", m.output_throughput))
    lines.append(_row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s))
    lines.append(_row("Peak concurrent requests:", m.max_concurrent_requests))
    lines.append(_row("Total token throughput (tok/s):", m.total_token_throughput))
    for key in METRIC_NAMES:
        if key not in cfg.percentile_metrics:
            continue
        short, header = _HEADERS[key]
        s = m.stats[key]
        lines.append("{:-^{w}}".format(header, w=WIDTH))
        lines.append(_row(f"Mean {short} (ms):", s.mean))
        lines.append(_row(f"Median {short} (ms):", s.median))
        for p, v in s.percentiles.items():
            lines.append(_row(f"{percentile_key(p).upper()} {short} (ms):", v))
    labels = sorted({r.label for r in result.requests})
    if len(labels) > 1 and len(labels) <= 8:
        lines.append("{:-^{w}}".format("By request class", w=WIDTH))
        for label, lm in per_label_metrics(result).items():
            lines.append(
                _row(
                    f"{label}: n / mean TTFT / mean TPOT (ms):",
                    f"{lm.completed} / {lm.stats['ttft'].mean:.2f} / {lm.stats['tpot'].mean:.2f}",
                )
            )
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def per_label_metrics(result: BenchmarkResult) -> dict[str, BenchmarkMetrics]:
    """Metrics of each request class (``SampleRequest.label``), same duration as the run."""
    groups: dict[str, list[RequestOutput]] = {}
    for req, out in zip(result.requests, result.outputs, strict=True):
        groups.setdefault(req.label, []).append(out)
    return {
        label: calculate_metrics(outs, result.metrics.duration_s, result.config.percentiles)
        for label, outs in sorted(groups.items())
    }


def _metric_fields(m: BenchmarkMetrics) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "duration": m.duration_s,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input,
        "total_output_tokens": m.total_output,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "good_completed": m.good_completed,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "max_output_tokens_per_s": m.max_output_tokens_per_s,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for key, s in m.stats.items():
        fields[f"mean_{key}_ms"] = s.mean
        fields[f"median_{key}_ms"] = s.median
        fields[f"std_{key}_ms"] = s.std
        for p, v in s.percentiles.items():
            fields[f"{percentile_key(p)}_{key}_ms"] = v
    return fields


def result_to_dict(
    result: BenchmarkResult, settings: dict[str, Any] | None = None, save_texts: bool = True
) -> dict[str, Any]:
    """The ``--save-result`` document. ``settings``: the command-line settings to record."""
    cfg = result.config
    outs = result.outputs
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "date": result.started_at,
        "label": cfg.label,
        "backend": "openai-chat" if cfg.endpoint.endswith("chat/completions") else "openai",
        "base_url": cfg.base_url,
        "endpoint": cfg.endpoint,
        "model_id": result.model,
        "num_prompts": len(result.requests),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "self_timed": result.self_timed,
        "percentiles": list(cfg.percentiles),
        "goodput_slos_ms": dict(cfg.slos_ms),
        "settings": dict(settings or {}),
    }
    doc.update(_metric_fields(result.metrics))
    doc.update(
        {
            "input_lens": [o.prompt_len for o in outs],
            "output_lens": [o.output_tokens if o.success else 0 for o in outs],
            "ttfts": [o.ttft for o in outs],
            "itls": [list(o.itl) for o in outs],
            "latencies": [o.latency for o in outs],
            "start_times": [o.start_time for o in outs],
            "queue_times": [o.queue_time for o in outs],
            "labels": [r.label for r in result.requests],
            "errors": [o.error for o in outs],
        }
    )
    if save_texts:
        doc["generated_texts"] = [o.generated_text for o in outs]
    return doc


def save_result(doc: dict[str, Any], path: str | Path) -> Path:
    """Validate and write ``doc`` as JSON (creating parent directories). Returns the path."""
    validate_result(doc)
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2) + "\n")
    return p


class ResultValidationError(ValueError):
    """A result document does not match the schema (message names the field)."""


_NUMBER = (int, float)
_REQUIRED: dict[str, tuple[type, ...]] = {
    "schema": (str,),
    "date": (str,),
    "label": (str,),
    "endpoint": (str,),
    "model_id": (str,),
    "num_prompts": (int,),
    "duration": _NUMBER,
    "completed": (int,),
    "failed": (int,),
    "total_input_tokens": (int,),
    "total_output_tokens": (int,),
    "request_throughput": _NUMBER,
    "output_throughput": _NUMBER,
    "total_token_throughput": _NUMBER,
    "good_completed": (int,),
    "percentiles": (list,),
    "settings": (dict,),
}
_ARRAYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors")


def validate_result(doc: Any) -> None:
    """Check a result document (from this tool; vLLM files pass the per-request part only).

    Checks types of the summary fields, that per-request arrays all have ``num_prompts`` entries,
    that ``completed + failed == num_prompts``, that latencies are finite and >= 0, and that every
    ``mean/median/std/p*`` statistic is present for each of TTFT, TPOT, ITL, E2EL.
    Raises ResultValidationError naming the first bad field.
    """
    if not isinstance(doc, dict):
        raise ResultValidationError("result must be a JSON object")
    if doc.get("schema") != SCHEMA:
        raise ResultValidationError(f"'schema' must be {SCHEMA!r}, got {doc.get('schema')!r}")
    for key, types in _REQUIRED.items():
        if key not in doc:
            raise ResultValidationError(f"missing field {key!r}")
        v = doc[key]
        if isinstance(v, bool) or not isinstance(v, types):
            raise ResultValidationError(f"field {key!r} has type {type(v).__name__}")
    n = doc["num_prompts"]
    if doc["completed"] + doc["failed"] != n:
        raise ResultValidationError(
            f"completed ({doc['completed']}) + failed ({doc['failed']}) != num_prompts ({n})"
        )
    if not 0 <= doc["good_completed"] <= doc["completed"]:
        raise ResultValidationError("'good_completed' must be within [0, completed]")
    for key in _ARRAYS:
        arr = doc.get(key)
        if not isinstance(arr, list) or len(arr) != n:
            raise ResultValidationError(f"field {key!r} must be a list of {n} entries")
    for key in ("ttfts", "latencies"):
        for i, v in enumerate(doc[key]):
            if not isinstance(v, _NUMBER) or not math.isfinite(v) or v < 0:
                raise ResultValidationError(f"{key}[{i}] = {v!r} is not a finite number >= 0")
    for i, gaps in enumerate(doc["itls"]):
        if not isinstance(gaps, list) or not all(isinstance(g, _NUMBER) for g in gaps):
            raise ResultValidationError(f"itls[{i}] must be a list of numbers")
    ok = sum(1 for e in doc["errors"] if not e)
    if ok != doc["completed"]:
        raise ResultValidationError(
            f"{ok} requests without error but completed = {doc['completed']}"
        )
    for metric in METRIC_NAMES:
        names = [f"{s}_{metric}_ms" for s in ("mean", "median", "std")]
        names += [f"{percentile_key(p)}_{metric}_ms" for p in doc["percentiles"]]
        for name in names:
            v = doc.get(name)
            if isinstance(v, bool) or not isinstance(v, _NUMBER) or not math.isfinite(v):
                raise ResultValidationError(f"statistic {name!r} missing or not a finite number")


def load_result(path: str | Path) -> dict[str, Any]:
    """Read and validate one result file. Raises ResultValidationError naming the file."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ResultValidationError(f"{p}: cannot read result JSON ({e})") from None
    try:
        validate_result(doc)
    except ResultValidationError as e:
        raise ResultValidationError(f"{p}: {e}") from None
    return doc


def per_request_tpots(doc: dict[str, Any]) -> list[float]:
    """TPOT (seconds) of each successful request with more than one output token."""
    return [
        (lat - ttft) / (n - 1)
        for lat, ttft, n, err in zip(
            doc["latencies"], doc["ttfts"], doc["output_lens"], doc["errors"], strict=True
        )
        if not err and n > 1
    ]


def default_filename(doc: dict[str, Any]) -> str:
    """``{label}-{rate}qps[-concurrency{c}]-{model}-{YYYYmmdd-HHMMSS}.json``."""
    model = str(doc["model_id"]).rstrip("/").split("/")[-1] or "model"
    conc = f"-concurrency{doc['max_concurrency']}" if doc.get("max_concurrency") else ""
    stamp = str(doc["date"]).replace("-", "").replace(":", "").replace("T", "-")
    return f"{doc['label']}-{doc['request_rate']}qps{conc}-{model}-{stamp}.json"
