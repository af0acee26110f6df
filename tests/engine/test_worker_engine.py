"""WorkerEngine (the step loop both workers run) and WorkerActor (their actor shell), on a fake
engine: wake-ups, failure handling, shutdown, and pings answered while the model loads."""

from __future__ import annotations

import asyncio
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from pdserve.config import EngineConfig
from pdserve.engine.actor import WorkerActor, restore_priority, threads_for
from pdserve.engine.errors import INTERNAL, UNAVAILABLE
from pdserve.engine.step_window import StepWindow
from pdserve.engine.worker_engine import WorkerEngine

pytestmark = pytest.mark.timeout(30)


class FakeEngine(WorkerEngine):
    """Each queued job is one 'token'; a job of None makes the step raise."""

    def __init__(self) -> None:
        runner: Any = SimpleNamespace(
            num_blocks=8, block_size=4, model_config=SimpleNamespace(max_position_embeddings=64)
        )
        super().__init__(EngineConfig(), runner, name="fake", idle_poll_s=5.0)
        self.jobs: list[str | None] = []
        self.done: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self.closed = 0

    def add(self, job: str | None) -> None:
        with self._lock:
            self.jobs.append(job)
        self.wake()

    def step(self) -> int:
        with self._lock:
            if not self.jobs:
                return 0
            job = self.jobs.pop(0)
            if job is None:
                raise RuntimeError("injected")
            self.done.append(job)
            self._record_step(0.001, 1, 1)
            return 1

    def has_work(self) -> bool:
        return bool(self.jobs)

    def _fail_all(self, code: str, message: str) -> None:
        with self._lock:
            self.failed += [(code, message)] + [(code, j) for j in self.jobs if j]
            self.jobs.clear()

    def _close_transport(self) -> None:
        self.closed += 1


def _wait(cond: Any, timeout_s: float = 5.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def test_loop_wakes_on_new_work_and_survives_a_failing_step() -> None:
    eng = FakeEngine()
    eng.start()
    eng.start()  # idempotent
    try:
        assert eng.is_running()
        t0 = time.monotonic()
        eng.add("a")
        _wait(lambda: eng.done == ["a"])
        assert time.monotonic() - t0 < 2.0  # woken, not the 5 s idle poll
        eng.add(None)  # the step raises: live work fails with INTERNAL, the loop keeps going
        _wait(lambda: bool(eng.failed))
        assert eng.failed[0][0] == INTERNAL and "injected" in eng.failed[0][1]
        eng.add("b")
        _wait(lambda: eng.done == ["a", "b"])
        assert eng.is_running() and eng.num_steps == 2
    finally:
        eng.shutdown()
    assert not eng.is_running() and eng.closed == 1 and eng.is_closed
    assert eng.failed[-1] == (UNAVAILABLE, "fake is shutting down")
    with pytest.raises(RuntimeError, match="shut down"):
        eng.start()


def test_run_until_idle_steps_in_this_thread() -> None:
    eng = FakeEngine()
    for j in "xyz":
        eng.jobs.append(j)
    assert eng.run_until_idle() == 3 and eng.done == ["x", "y", "z"]
    assert eng.kv.num_blocks == 8 and eng.max_model_len == 64
    _, rate = eng.window.rates()
    assert rate > 0


def test_step_window_rates() -> None:
    w = StepWindow(window_s=10.0)
    now = time.monotonic()
    w.add(now, 0.010, 5, 2)
    w.add(now, 0.030, 5, 4)
    step_ms, rate = w.rates(now)
    assert step_ms == pytest.approx(20.0) and rate > 0 and w.mean_batch(now) == 3.0
    assert w.rates(now + 11) == (0.0, 0.0)  # the steps left the window
    assert w.mean_batch(now + 11) == 0.0 and w.total_tokens == 10  # the total stays


class SlowActor(WorkerActor[FakeEngine]):
    role = "fake"

    def __init__(self) -> None:
        super().__init__("fake-0", EngineConfig(), num_cpus=1.0)
        self.loading = threading.Event()
        self.release = threading.Event()

    def build_engine(self, config: EngineConfig) -> FakeEngine:
        self.loading.set()
        assert self.release.wait(10.0)  # a long weight load, off the event loop
        return FakeEngine()

    async def serve(
        self,
        engine: FakeEngine,
        host: str,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> tuple[grpc.aio.Server, str]:
        engine.start()
        server = grpc.aio.server(interceptors=list(interceptors))
        port = server.add_insecure_port(f"{host}:0")
        await server.start()
        return server, f"{host}:{port}"


async def test_actor_answers_pings_while_the_model_loads() -> None:
    actor = SlowActor()
    start = asyncio.create_task(actor.start())
    while not actor.loading.is_set():
        await asyncio.sleep(0.01)
    assert await asyncio.wait_for(actor.ping(), 1.0)  # the event loop is free during the load
    actor.release.set()
    info = await start
    assert info.grpc_address.startswith(f"{info.node_address}:")  # binds what it advertises
    assert info.role == "fake" and info.num_blocks == 8 and info.kv_endpoint == ""
    assert await actor.start() is info  # idempotent
    assert await actor.ping()
    engine = actor.engine
    await actor.stop()
    assert engine is not None and engine.is_closed and actor.engine is None


def test_threads_for() -> None:
    assert threads_for(0.5) == 1 and threads_for(1.0) == 1 and threads_for(2.4) == 2


def _may_raise_priority() -> bool:
    """CAP_SYS_NICE (bit 23 of the effective capabilities) or an RLIMIT_NICE reaching 0."""
    with open("/proc/self/status") as f:
        caps = next(int(ln.split()[1], 16) for ln in f if ln.startswith("CapEff:"))
    return bool(caps >> 23 & 1) or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


# The subprocess's check: the niceness of every thread alive at the end (a thread that ended
# between the listing and the read is skipped: short-lived threads of the imports made the read
# raise ProcessLookupError now and then on a Zen 5 EPYC, and a non-daemon thread then hung the
# child past the test's timeout).
_NICENESSES = (
    "import os, threading\n"
    "from pdserve.engine.actor import restore_priority\n"
    "def nicenesses():\n"
    "    out = []\n"
    "    for t in os.listdir('/proc/self/task'):\n"
    "        try:\n"
    "            out.append(os.getpriority(os.PRIO_PROCESS, int(t)))\n"
    "        except ProcessLookupError:\n"
    "            pass\n"
    "    return out\n"
)


def test_restore_priority_undoes_rays_niceness_when_allowed() -> None:
    # A process started at niceness 15, as Ray starts its workers, with a second thread running
    # (Linux niceness is per thread: every thread must be set).
    code = (
        _NICENESSES + "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait, daemon=True).start()\n"
        "got = restore_priority()\n"
        "seen = nicenesses()\n"
        "print(got, *sorted(set(seen)), len(seen))\n"
        "stop.set()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: os.nice(15),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    want = 0 if _may_raise_priority() else 15
    assert out[:2] == [str(want), str(want)] and int(out[2]) >= 2  # the caller, then all threads
    assert restore_priority() == os.getpriority(os.PRIO_PROCESS, 0)  # at 0 already: unchanged


def test_restore_priority_raises_every_thread_to_a_prefill_niceness() -> None:
    """A prefill worker's niceness (--prefill-niceness) reaches every thread, the ones alive
    now and, by inheritance, the ones they start later; raising needs no privilege."""
    code = (
        _NICENESSES + "stop = threading.Event()\n"
        "threading.Thread(target=stop.wait, daemon=True).start()\n"
        "got = restore_priority(5)\n"
        "later = []\n"
        "t = threading.Thread(target=lambda: later.append(os.getpriority(os.PRIO_PROCESS, 0)))\n"
        "t.start(); t.join()\n"
        "print(got, *sorted(set(nicenesses())), *later)\n"
        "stop.set()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    assert out == ["5", "5", "5"]
