"""One suite run as a record: where its result file is, its headline numbers, and its floors.

Headline numbers are read from a result JSON by key, so files of ``pdserve bench serve`` and of
``vllm bench serve --save-result --save-detailed`` (same key names) are summarised alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.bench.floors import ModelCost, run_floors
from pdserve.bench.machine import MachineRates
from pdserve.bench.metrics import METRIC_NAMES

# Run names of one server: the main workload (our client, vLLM's client) and the mixed workload.
RUN_MAIN = "main"
RUN_MAIN_PEER_CLIENT = "main-vllm-client"
RUN_SHORT_ALONE = "short-alone"
RUN_SHORT_MIXED = "short-mixed"
RUN_LONG_MIXED = "long-mixed"
RUN_MIXED_BOTH = "mixed-both-clients"  # the floor of the short + long work of the mixed run

SUMMARY_FIELDS = (
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput",
)  # fmt: skip
STAT_PREFIXES = ("mean", "median", "p50", "p90", "p99")


@dataclass
class RunRecord:
    """A finished run. ``file``: its result JSON relative to the results directory;
    ``summary``: headline numbers (``output_throughput``, ``p99_tpot_ms`` ...); ``floors``: a
    :class:`pdserve.bench.floors.RunFloors` dict plus ``duration_over_floor``."""

    server: str
    run: str
    client: str  # 'pdserve' | 'vllm'
    file: str
    summary: dict[str, Any]
    floors: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "server": self.server, "run": self.run, "client": self.client, "file": self.file,
            "summary": self.summary, "floors": self.floors, **self.extra,
        }  # fmt: skip


def headline(doc: dict[str, Any]) -> dict[str, Any]:
    """Summary fields and mean/median/p50/p90/p99 of TTFT, TPOT, ITL, E2EL (ms) that ``doc``
    holds; absent keys are left out."""
    out = {k: doc[k] for k in SUMMARY_FIELDS if k in doc}
    for metric in METRIC_NAMES:
        for prefix in STAT_PREFIXES:
            key = f"{prefix}_{metric}_ms"
            if key in doc:
                out[key] = doc[key]
    return out


def completed_lengths(doc: dict[str, Any]) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of each request that succeeded in a detailed result."""
    errors = doc.get("errors") or [""] * len(doc.get("input_lens") or [])
    return [
        (int(p), int(o))
        for p, o, e in zip(
            doc.get("input_lens") or [], doc.get("output_lens") or [], errors, strict=False
        )  # fmt: skip
        if not e
    ]


def time_span_s(docs: Sequence[dict[str, Any]]) -> float:
    """Seconds from the first request's start to the last one's end across result files written
    by one process (their ``start_times`` share one clock); 0.0 when no request succeeded."""
    starts: list[float] = []
    ends: list[float] = []
    for doc in docs:
        for s, lat, e in zip(doc["start_times"], doc["latencies"], doc["errors"], strict=True):
            if not e:
                starts.append(s)
                ends.append(s + lat)
    return max(ends) - min(starts) if starts else 0.0


def floors_for(
    cost: ModelCost,
    machine: MachineRates,
    lengths: Sequence[tuple[int, int]],
    max_batch: int,
    duration_s: float,
) -> dict[str, Any]:
    """The floors of a run of ``lengths`` requests (at most ``max_batch`` in flight) against the
    machine's best measured rates, with ``duration_s`` and ``duration_over_floor``."""
    floors = run_floors(cost, lengths, max_batch, machine.peak_gflops, machine.peak_copy_gbs)
    doc = floors.to_dict()
    doc["duration_s"] = duration_s
    doc["duration_over_floor"] = duration_s / floors.floor_s if floors.floor_s > 0 else None
    return doc
