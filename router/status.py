"""The cluster as one JSON picture (``GET /v1/cluster/status``) and its recent history.

:class:`ClusterMonitor` joins three sources: the worker pool (membership, health and each
worker's polled ``GetStats``), the cluster controller when there is one (restart counts, workers
being retired by a scale-down), and the router's own :class:`~router.serving_stats.ServingStats`
and admission queue. ``snapshot()`` is the status API's body; ``history()`` is a time series of
the numbers the dashboard charts, sampled every ``interval_s`` seconds by a background task
(:meth:`ClusterMonitor.ensure_started`) and kept for ``history_s`` seconds.

Worker throughput over the last minute is computed here from the running totals workers report
(``prompt_tokens_computed`` on prefill workers, ``generation_tokens`` on decode workers): the
difference between the newest sample and the newest one at least 60 s older, divided by the time
between them (a shorter span while the worker is younger than a minute; a counter that went
backwards means a restarted worker, whose history starts again).

A worker is *lost* when it turns unhealthy or leaves the pool without being retired by a
scale-down; ``lost_workers`` lists it (for the dashboard's banner) until it is healthy again or
``lost_memory_s`` seconds have passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pdserve.v1 import worker_pb2 as pb
from router.pool import WorkerState
from router.serving_stats import WINDOWS_S

if TYPE_CHECKING:
    from router.serving import Router

log = logging.getLogger(__name__)

RATE_WINDOW_S = 60.0  # workers' tokens/s "over the last minute"


class Describable(Protocol):
    """The part of the cluster controller (router/cluster.py) the monitor reads."""

    def describe(self) -> list[dict[str, Any]]: ...


@dataclass
class _WorkerTrack:
    """What the monitor remembers of one worker between samples."""

    role: str
    totals: deque[tuple[float, int]] = field(default_factory=deque)  # (t s, running total)
    healthy: bool = True

    def add_total(self, now: float, total: int) -> None:
        if self.totals and total < self.totals[-1][1]:
            self.totals.clear()  # a restarted worker counts from 0 again
        self.totals.append((now, total))
        while len(self.totals) > 2 and self.totals[1][0] <= now - RATE_WINDOW_S:
            self.totals.popleft()

    def rate(self) -> float | None:
        """Tokens per second over (at most) the last minute; None before two samples."""
        if len(self.totals) < 2:
            return None
        (t0, n0), (t1, n1) = self.totals[0], self.totals[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None


def _worker_view(w: WorkerState, track: _WorkerTrack | None, restarts: int | None) -> dict:
    info = w.info
    s = w.stats
    node = info.grpc_address.rsplit(":", 1)[0] if info.grpc_address else None
    if not w.healthy:
        health = "unhealthy"
    elif s is None:
        health = "starting"
    else:
        health = "healthy"
    view: dict[str, Any] = {
        "id": w.worker_id,
        "role": info.role,
        "node": node,
        "grpc_address": info.grpc_address,
        "kv_endpoint": info.kv_endpoint or None,
        "health": health,
        "restarts": restarts,
        "stats_age_s": round(time.monotonic() - w.stats_at, 3) if w.stats_at else None,
        "router_inflight": w.inflight,
    }
    if isinstance(s, pb.DecodeStats):
        used, total = s.kv_blocks_total - s.kv_blocks_free, s.kv_blocks_total
        view |= {
            "running": s.num_running,
            "waiting": s.num_waiting + s.num_waiting_for_kv,
            "waiting_for_kv": s.num_waiting_for_kv,
            "prefix_cache_hit_rate": None,
            "batch_size": round(s.batch_size, 3),
            "step_time_ms": round(s.step_time_ms, 3),
            "tokens_per_s": round(s.generation_tokens_per_s, 3),
            "kv_bytes_sent": 0,
            "kv_bytes_received": s.transfer_bytes_received,
            "preemptions": s.num_preemptions,
            "finished": s.num_finished,
        }
    elif isinstance(s, pb.PrefillStats):
        used, total = s.kv_blocks_used, s.kv_blocks_total
        view |= {
            "running": s.num_running,
            "waiting": s.num_waiting,
            "queued_tokens": s.num_queued_tokens,
            "prefix_cache_hit_rate": round(s.prefix_cache_hit_rate, 4),
            "batch_size": round(s.batch_size, 3),
            "step_time_ms": round(s.step_time_ms, 3),
            "tokens_per_s": round(s.prompt_tokens_per_s, 3),
            "kv_bytes_sent": s.transfer_bytes,
            "kv_bytes_received": 0,
            "prefills": s.num_prefills,
            "kv_transfer_failures": s.transfer_failures,
        }
    else:  # not polled yet: the geometry it registered with, and the common keys unknown
        used, total = 0, info.num_blocks
        view |= dict.fromkeys(
            ("running", "waiting", "prefix_cache_hit_rate", "batch_size", "step_time_ms",
             "tokens_per_s", "kv_bytes_sent", "kv_bytes_received"),
        )  # fmt: skip
    rate = track.rate() if track is not None else None
    view |= {
        "kv_blocks_used": used,
        "kv_blocks_total": total,
        "kv_usage": round(used / total, 4) if total else 0.0,
        "tokens_per_s_1m": None if rate is None else round(rate, 3),
    }
    return view


def _running_total(s: pb.PrefillStats | pb.DecodeStats | None) -> int | None:
    if isinstance(s, pb.DecodeStats):
        return s.generation_tokens
    if isinstance(s, pb.PrefillStats):
        return s.prompt_tokens_computed
    return None


class ClusterMonitor:
    """Status snapshots and chart history for one router (see the module docstring).

    ``interval_s`` > 0: seconds between history samples. ``history_s``: seconds of history kept.
    ``control``: the cluster controller (restart counts, retiring workers), None without Ray.
    """

    def __init__(
        self,
        router: Router,
        control: Describable | None = None,
        interval_s: float = 2.0,
        history_s: float = 600.0,
        lost_memory_s: float = 300.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.router = router
        self.control = control
        self.interval_s = interval_s
        self.lost_memory_s = lost_memory_s
        self.clock = clock
        self.started = clock()
        self._tracks: dict[str, _WorkerTrack] = {}
        self._retiring: set[str] = set()
        self._lost: dict[str, dict[str, Any]] = {}
        self._history: deque[dict[str, Any]] = deque(maxlen=max(1, int(history_s / interval_s)))
        self._task: asyncio.Task[None] | None = None
        self._last_sample = 0.0

    # -- sampling ---------------------------------------------------------------------------------

    def ensure_started(self) -> None:
        """Start the background sampler in the running loop (idempotent, cheap)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._sample_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sample_forever(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - the dashboard must never take the router down
                log.exception("status sample failed")
            await asyncio.sleep(self.interval_s)

    def _describe(self) -> dict[str, dict[str, Any]]:
        if self.control is None:
            return {}
        try:
            return {d["worker_id"]: d for d in self.control.describe()}
        except Exception:  # noqa: BLE001 - a controller mid-change; restarts shown as unknown
            log.debug("describe() failed", exc_info=True)
            return {}

    def _observe_workers(self, now: float, described: dict[str, dict[str, Any]]) -> None:
        """Update running totals and the lost-worker list from the pool."""
        self._retiring |= {wid for wid, d in described.items() if d.get("retiring")}
        present = {}
        for w in self.router.pool:
            present[w.worker_id] = w
            track = self._tracks.setdefault(w.worker_id, _WorkerTrack(w.info.role))
            total = _running_total(w.stats)
            if total is not None and w.healthy:
                track.add_total(now, total)
            if w.healthy:
                self._lost.pop(w.worker_id, None)
            elif track.healthy:
                self._lose(w.worker_id, w.info.role, "unhealthy: not answering GetStats", now)
            track.healthy = w.healthy
        for wid in list(self._tracks):
            if wid not in present:
                track = self._tracks.pop(wid)
                if wid in self._retiring:
                    self._retiring.discard(wid)
                else:
                    self._lose(wid, track.role, "left the cluster", now)
        for wid, lost in list(self._lost.items()):
            if now - lost["since"] > self.lost_memory_s:
                del self._lost[wid]

    def _lose(self, worker_id: str, role: str, reason: str, now: float) -> None:
        log.warning("status: worker %s (%s) lost: %s", worker_id, role, reason)
        self._lost[worker_id] = {"id": worker_id, "role": role, "reason": reason, "since": now}

    def sample(self) -> dict[str, Any]:
        """Take one history point now (also refreshes worker rates and lost workers)."""
        now = self.clock()
        described = self._describe()
        self._observe_workers(now, described)
        stats = self.router.stats
        ttft = stats.ttft.summary(60.0)
        tpot = stats.tpot.summary(60.0)
        kv_usage, waiting = {}, self.router.admission.num_queued
        for w in self.router.pool:
            view = _worker_view(w, None, None)
            kv_usage[w.worker_id] = view["kv_usage"]
            waiting += view.get("waiting") or 0
        point = {
            "t": round(now, 3),
            "ttft_p50_ms": _ms(ttft.p50),
            "ttft_p99_ms": _ms(ttft.p99),
            "tpot_p50_ms": _ms(tpot.p50),
            "tpot_p99_ms": _ms(tpot.p99),
            "output_tokens_per_s": round(stats.output_tokens.per_second(10.0), 3),
            "kv_transfer_bytes_per_s": round(stats.kv_transfer_bytes.per_second(10.0), 1),
            "running": stats.running,
            "queue_depth": waiting,
            "kv_usage": kv_usage,
        }
        self._history.append(point)
        self._last_sample = now
        return point

    # -- views ------------------------------------------------------------------------------------

    def history(self) -> dict[str, Any]:
        """``{"interval_s", "points": [...]}``, oldest first (see :meth:`sample`)."""
        if self.clock() - self._last_sample >= self.interval_s:
            self.sample()
        return {"interval_s": self.interval_s, "points": list(self._history)}

    def snapshot(self) -> dict[str, Any]:
        """The status API's body (fields listed in the README's "Operators" section)."""
        now = self.clock()
        described = self._describe()
        self._observe_workers(now, described)
        router = self.router
        stats = router.stats
        adm = router.admission
        workers = []
        for w in sorted(router.pool, key=lambda w: (w.info.role != "prefill", w.worker_id)):
            restarts = described.get(w.worker_id, {}).get("restarts")
            workers.append(_worker_view(w, self._tracks.get(w.worker_id), restarts))
        unified = router.config.lifecycle.unified or not router.pool.workers("prefill")
        c = stats.counts
        return {
            "time": round(now, 3),
            "uptime_s": round(now - self.started, 3),
            "model": router.model_name,
            "max_model_len": router.max_model_len,
            "mode": "unified" if unified else "disaggregated",
            "workers": workers,
            "lost_workers": sorted(self._lost.values(), key=lambda x: x["since"]),
            "requests": {
                "running": stats.running,
                "waiting": adm.num_queued,
                "total": c["requests"],
                "finished": dict(stats.finished),
                "aborted": c["aborted"],
                "rejected": c["rejected"],
                "client_disconnects": c["client_disconnects"],
                "preemptions": c["preemptions"],
                "migrations": c["migrations"],
            },
            "tokens": {
                "prompt": c["prompt_tokens"],
                "generation": c["generation_tokens"],
                "cached_prompt": c["cached_prompt_tokens"],
            },
            "kv_transfers": {
                "transferred": c["kv_transfers_transferred"],
                "local": c["kv_transfers_local"],
                "failed": c["kv_transfers_failed"],
                "bytes": c["kv_transfer_bytes"],
            },
            "admission": {
                "queued_requests": adm.num_queued,
                "queued_tokens": adm.queued_tokens,
                "max_queued_requests": adm.max_queued_requests,
                "max_queued_tokens": adm.max_queued_tokens,
                "rejected": adm.num_rejected,
                "retry_after_s": adm.retry_after_s(),
                "state": _admission_state(adm.num_queued, adm.max_queued_requests),
            },
            "latency": stats.latency(),
            "throughput": stats.throughput(),
            "windows_s": WINDOWS_S,
        }


def _admission_state(queued: int, limit: int) -> str:
    """'open' (room), 'busy' (>= 80 % of the request limit queued) or 'full' (at the limit)."""
    if queued >= limit:
        return "full"
    return "busy" if queued >= 0.8 * limit else "open"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)
