"""The router's view of its workers: membership, health and load, fed by polling GetStats.

Membership changes come from outside (``router/cluster.py`` on Ray, or tests): ``upsert`` adds a
worker or replaces one whose address changed (a restarted actor), ``remove`` drops it. A dropped
or replaced worker gets no new requests, but its channel stays open until the router has no call
left on it (its :attr:`WorkerState.inflight` is 0), so a worker being scaled down drains: the
prefills and decode streams it already runs finish (:meth:`WorkerPool.inflight` tells the cluster
when it may stop the worker). A
background task polls every worker's GetStats each ``stats_interval_s``; a worker that fails
``unhealthy_after`` polls (or RPCs, via :meth:`WorkerPool.report_failure`) with no successful poll
between them is skipped by placement until a poll succeeds again.

A poll (or an RPC: a late Accepted, DEADLINE_EXCEEDED) that times out is not a failure by
itself: a worker (or a router whose own event loop is starved by a flood of requests) can be late
under load, and marking a loaded worker unhealthy turns overload into 503s and removes capacity
exactly when it is needed. A timeout counts only once the worker has gone
``unresponsive_after_s`` seconds without a successful poll; a refused connection or any other
error counts at once. So a host that vanishes without refusing connections (a dropped network) is
marked unhealthy after about ``unresponsive_after_s`` plus ``unhealthy_after`` poll timeouts
(~13 s by default) instead of two timeouts (~3 s); its requests in flight are re-placed as their
streams fail. This is the liveness probe's usual split between a failed probe and a slow one
(Kubernetes: ``timeoutSeconds`` x ``failureThreshold``).

Between polls the router corrects stale stats with its own bookkeeping, counting only what the
last report cannot hold: every placement gets a number (a tick), each poll remembers the last
tick placed before it was sent, and a placement counts on top of the report only when it came
after that poll. Requests placed on a decode worker since then count as running and their blocks
as used; prompts sent to a prefill worker since then count as queued (until the Prefill call
returns). A placement the last report already holds is not counted twice. A prompt sent just
before a poll that reaches the worker after it is in neither count until the next poll (at most
``stats_interval_s`` late).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from pdserve import metrics
from pdserve.v1 import worker_pb2 as pb
from pdserve.worker_info import WorkerInfo
from router.policy import DecodeLoad, PrefillLoad
from router.worker_client import WorkerClient

log = logging.getLogger(__name__)


WORKER_SLOW = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED})
"""Status codes of a worker that may be alive but late: they count toward marking it unhealthy
only once it has also gone unanswered for ``unresponsive_after_s`` (see the module docstring)."""


@dataclass
class WorkerState:
    """One worker as the pool tracks it. Counts are router-side unless named ``stats``; only
    the pool changes them (:meth:`WorkerPool.reserve` / :meth:`WorkerPool.release`, polls)."""

    client: WorkerClient
    healthy: bool = True
    stats: pb.PrefillStats | pb.DecodeStats | None = None
    stats_at: float = 0.0  # time.monotonic() of the last successful poll
    failures: int = 0  # consecutive failed polls / RPCs
    added_at: float = field(default_factory=time.monotonic)  # when the pool learned of it
    inflight: int = 0  # requests the router has placed here and not finished
    # the last placement tick (WorkerPool.reserve) sent before the poll that gave ``stats``
    stats_tick: int = 0
    # prefill: prompts sent, Prefill not yet returned, as {placement tick: prompt tokens}
    inflight_prompts: dict[int, int] = field(default_factory=dict)
    # decode: placements after ``stats_tick``, as (placement tick, KV blocks reserved)
    new_placements: list[tuple[int, int]] = field(default_factory=list)
    local_prefill_tokens: int = 0  # decode: prompt tokens sent to be prefilled there, not yet done

    @property
    def info(self) -> WorkerInfo:
        return self.client.info

    @property
    def worker_id(self) -> str:
        return self.client.worker_id


class WorkerPool:
    """Workers by id and role. ``stats_interval_s`` > 0 seconds; ``unhealthy_after`` >= 1;
    ``unresponsive_after_s`` (seconds) > 0: how long polls may time out before they count.

    ``internal_token``: what every worker call presents (pdserve/auth.py); None = none.
    """

    def __init__(
        self,
        stats_interval_s: float = 0.5,
        unhealthy_after: int = 2,
        internal_token: str | None = None,
        unresponsive_after_s: float = 10.0,
    ) -> None:
        if stats_interval_s <= 0:
            raise ValueError(f"stats_interval_s must be > 0, got {stats_interval_s}")
        if unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {unhealthy_after}")
        if unresponsive_after_s <= 0:
            raise ValueError(f"unresponsive_after_s must be > 0, got {unresponsive_after_s}")
        self.stats_interval_s = stats_interval_s
        self.unhealthy_after = unhealthy_after
        self.unresponsive_after_s = unresponsive_after_s
        self.internal_token = internal_token
        self._workers: dict[str, WorkerState] = {}
        self._tick = 0  # placements so far (reserve): orders them against polls
        self._changed = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        # dropped or replaced workers whose channels close once nothing is in flight on them
        self._retired: list[WorkerState] = []

    # -- membership -------------------------------------------------------------------------

    def upsert(self, info: WorkerInfo) -> WorkerState:
        """Add ``info``, or replace the entry with the same id when its address changed."""
        old = self._workers.get(info.worker_id)
        if old is not None and old.info == info:
            return old
        if old is not None:
            self._retired.append(old)
        state = WorkerState(client=WorkerClient(info, self.internal_token))
        self._workers[info.worker_id] = state
        log.info("worker %s (%s) at %s registered", info.worker_id, info.role, info.grpc_address)
        self._notify()
        return state

    def remove(self, worker_id: str) -> bool:
        """Drop a worker: nothing new is placed on it; its channel closes once the calls in
        flight on it have finished (the module docstring). Returns whether it was known."""
        state = self._workers.pop(worker_id, None)
        if state is None:
            return False
        self._retired.append(state)
        metrics.forget_worker(worker_id, state.info.role)
        log.info("worker %s removed", worker_id)
        self._notify()
        return True

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self, timeout_s: float) -> None:
        """Wait until membership or health changes, or ``timeout_s`` seconds pass."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout_s)

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def workers(self, role: str, healthy_only: bool = True) -> list[WorkerState]:
        """Workers of ``role`` ('prefill' | 'decode'), by id."""
        return sorted(
            (
                w
                for w in self._workers.values()
                if w.info.role == role and (w.healthy or not healthy_only)
            ),
            key=lambda w: w.worker_id,
        )

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(list(self._workers.values()))

    def inflight(self, worker_id: str) -> int:
        """Requests the router has on worker ``worker_id`` now (prefill calls and decode
        streams), counting its dropped or replaced entries until they drain."""
        states = [w for w in self._retired if w.worker_id == worker_id]
        live = self._workers.get(worker_id)
        if live is not None:
            states.append(live)
        return sum(w.inflight for w in states)

    async def _close_drained(self) -> None:
        """Close the channels of dropped workers that have nothing in flight any more."""
        draining = []
        for w in self._retired:
            if w.inflight > 0:
                draining.append(w)
            else:
                await w.client.close()
        self._retired = draining

    # -- router-side load between polls ----------------------------------------------------

    def reserve(
        self,
        worker: WorkerState,
        *,
        blocks: int = 0,
        tokens: int = 0,
        local_prefill_tokens: int = 0,
    ) -> int:
        """Count one request the router placed on ``worker`` until :meth:`release`; returns its
        placement tick, for :meth:`release`.

        Decode: one more running sequence and ``blocks`` KV blocks, both until a poll sent after
        this placement reports them, and ``local_prefill_tokens`` prompt tokens it prefills
        itself until :meth:`prefilled_locally`. Prefill: ``tokens`` prompt tokens queued until
        such a poll reports them or the Prefill call returns (:meth:`release`), whichever comes
        first (see the module docstring).
        """
        self._tick += 1
        worker.inflight += 1
        if tokens:
            worker.inflight_prompts[self._tick] = tokens
        if worker.info.role == "decode":
            worker.new_placements.append((self._tick, blocks))
            worker.local_prefill_tokens += local_prefill_tokens
        return self._tick

    def prefilled_locally(self, worker: WorkerState, tokens: int) -> None:
        """The local prefill of ``tokens`` prompt tokens counted by ``reserve`` is done (or
        gone)."""
        worker.local_prefill_tokens -= tokens

    def release(self, worker: WorkerState, tick: int) -> None:
        """The request that :meth:`reserve` counted under ``tick`` left ``worker``."""
        worker.inflight -= 1
        worker.inflight_prompts.pop(tick, None)

    # -- load snapshots for the policy -------------------------------------------------------

    def decode_loads(self) -> list[DecodeLoad]:
        """Healthy decode workers' load, corrected by router-side placements since the last poll."""
        loads = []
        for w in self.workers("decode"):
            s = w.stats
            new_blocks = sum(blocks for _, blocks in w.new_placements)
            if isinstance(s, pb.DecodeStats):
                free = s.kv_blocks_free - new_blocks
                running = s.num_running + s.num_waiting_for_kv + s.num_waiting
                running += len(w.new_placements)
            else:  # never polled yet: assume the geometry it reported at start
                free = w.info.num_blocks - new_blocks
                running = w.inflight
            loads.append(
                DecodeLoad(
                    w.worker_id,
                    free_blocks=free,
                    running=running,
                    local_prefill_tokens=w.local_prefill_tokens,
                )
            )
        return loads

    def prefill_loads(self) -> list[PrefillLoad]:
        """Healthy prefill workers' queued prompt tokens (as last reported, plus the prompts this
        router sent since that report's poll), in all and of the short class (prompts of at most
        the worker's reported long threshold)."""
        loads = []
        for w in self.workers("prefill"):
            s = w.stats if isinstance(w.stats, pb.PrefillStats) else pb.PrefillStats()
            threshold = s.long_prefill_token_threshold
            unseen = [n for tick, n in w.inflight_prompts.items() if tick > w.stats_tick]
            inflight = sum(unseen)
            short = sum(n for n in unseen if n <= threshold)
            loads.append(
                PrefillLoad(
                    w.worker_id,
                    queued_tokens=s.num_queued_tokens + inflight,
                    queued_short_tokens=s.num_queued_short_tokens + short,
                    long_threshold=threshold,
                )
            )
        return loads

    # -- health ------------------------------------------------------------------------------

    def report_failure(self, worker_id: str, *, slow: bool = False) -> bool:
        """An RPC to the worker failed in a way that suggests it is down.

        ``slow``: the RPC timed out rather than failed; it counts only once the worker has gone
        ``unresponsive_after_s`` seconds without a successful poll. Returns whether it counted.
        """
        w = self._workers.get(worker_id)
        if w is None:
            return False
        if slow and time.monotonic() - (w.stats_at or w.added_at) < self.unresponsive_after_s:
            return False
        w.failures += 1
        if w.healthy and w.failures >= self.unhealthy_after:
            w.healthy = False
            log.warning("worker %s marked unhealthy", worker_id)
            self._notify()
        return True

    async def poll_once(self) -> None:
        """Poll every worker's GetStats once (concurrently) and update health."""
        await self._close_drained()
        states = list(self._workers.values())
        sent = self._tick  # placements up to here reach the workers before this poll does
        results = await asyncio.gather(
            *(w.client.get_stats(timeout_s=max(1.0, 2 * self.stats_interval_s)) for w in states),
            return_exceptions=True,
        )
        for w, r in zip(states, results, strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, grpc.aio.AioRpcError):
                    log.error("GetStats on %s raised %r", w.worker_id, r)
                if not self.report_failure(w.worker_id, slow=_slow(r)):
                    continue  # late, not down: see the module docstring
                metrics.set_worker_load(w.worker_id, w.info.role, up=False)
                continue
            _publish(w.worker_id, r)
            w.stats = r
            w.stats_at = time.monotonic()
            w.stats_tick = sent
            w.new_placements = [p for p in w.new_placements if p[0] > sent]
            w.failures = 0
            if not w.healthy:
                w.healthy = True
                log.info("worker %s healthy again", w.worker_id)
                self._notify()

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the poller must survive anything
                log.exception("worker stats poll failed")
            await asyncio.sleep(self.stats_interval_s)

    def start(self) -> None:
        """Start the background stats poller (idempotent); needs a running event loop."""
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def close(self) -> None:
        """Stop polling and close every channel."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for w in list(self._workers.values()):
            await w.client.close()
        for retired in self._retired:
            await retired.client.close()
        self._retired.clear()
        self._workers.clear()


def _slow(err: BaseException) -> bool:
    """Whether a failed GetStats timed out (the worker may be alive and busy)."""
    if isinstance(err, TimeoutError):
        return True
    return isinstance(err, grpc.aio.AioRpcError) and err.code() in WORKER_SLOW


def _publish(worker_id: str, s: pb.PrefillStats | pb.DecodeStats) -> None:
    """Copy a worker's polled stats into the Prometheus gauges."""
    role = "decode" if isinstance(s, pb.DecodeStats) else "prefill"
    if isinstance(s, pb.DecodeStats):
        used = s.kv_blocks_total - s.kv_blocks_free
        metrics.set_worker_load(
            worker_id,
            "decode",
            up=True,
            kv_usage=used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
            running=s.num_running,
            waiting=s.num_waiting + s.num_waiting_for_kv,
        )
        tokens_per_s = s.generation_tokens_per_s
    else:
        metrics.set_worker_load(
            worker_id,
            "prefill",
            up=True,
            kv_usage=s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
            running=s.num_running,
            waiting=s.num_waiting,
            prefix_hit_rate=s.prefix_cache_hit_rate,
        )
        tokens_per_s = s.prompt_tokens_per_s
    metrics.set_worker_steps(worker_id, role, s.step_time_ms / 1e3, s.batch_size, tokens_per_s)
