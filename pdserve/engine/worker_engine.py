"""The shell both worker engines share: the step loop thread, its wake event, the step window,
failure handling and shutdown.

A worker engine is plain Python (no Ray, no gRPC): the service and the actor wrap it. Subclasses
(``PrefillEngine``, ``DecodeEngine``) supply what differs: :meth:`WorkerEngine.step` (their
scheduling policy and KV send or receive), :meth:`WorkerEngine.has_work` and how to fail every
live request. Threading contract: every engine mutation happens under ``self._lock`` (re-entrant);
a subclass runs its forward outside it, so requests and aborts from other threads (the gRPC
event loop) never wait for a forward. Anything that makes new work (a request, an abort, a KV
transfer completing) calls :meth:`WorkerEngine.wake`. Tests may call ``step()`` themselves
instead of :meth:`WorkerEngine.start`.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from pdserve.config import EngineConfig
from pdserve.engine.errors import INTERNAL, UNAVAILABLE
from pdserve.engine.faults import FaultInjector, WorkerKilled
from pdserve.engine.step_window import StepWindow
from pdserve.kv_cache.manager import KVCacheManager

if TYPE_CHECKING:
    from pdserve.engine.runner import ModelRunner

log = logging.getLogger(__name__)


class WorkerEngine(ABC):
    """Base of the prefill and decode engines over one ModelRunner and its KV pool.

    ``name``: names the loop thread and log lines (e.g. 'decode-0'). ``idle_poll_s``: seconds the
    loop sleeps when a step computed nothing and no wake-up came (it still expires deadlines and
    applies transfer completions at that pace). ``faults``: fault injection (tests,
    ``--enable-fault-injection``; see pdserve/engine/faults.py), None = none.
    """

    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        *,
        name: str,
        idle_poll_s: float = 0.05,
        faults: FaultInjector | None = None,
    ) -> None:
        self.config = config
        self.faults = faults
        self.runner = runner
        self.name = name
        self.idle_poll_s = idle_poll_s
        self.kv = KVCacheManager(
            runner.num_blocks, runner.block_size, config.cache.enable_prefix_caching
        )
        self.max_model_len = min(
            config.scheduler.max_model_len, runner.model_config.max_position_embeddings
        )
        self.window = StepWindow()
        self.num_steps = 0
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------------ what differs
    @abstractmethod
    def step(self) -> int:
        """Run one step; return the number of tokens computed (0 when there was nothing to
        compute). A forward failure fails that step's requests and is not raised."""

    @abstractmethod
    def has_work(self) -> bool:
        """True while a step would compute something (or a transfer completion is queued)."""

    @abstractmethod
    def _fail_all(self, code: str, message: str) -> None:
        """End every live request with ``code`` and free what it holds."""

    @abstractmethod
    def _close_transport(self) -> None:
        """Close the KV sender or receiver when this engine built it (after the loop stopped)."""

    # ------------------------------------------------------------------------ the loop
    @property
    def is_closed(self) -> bool:
        """True once :meth:`shutdown` began: new requests are refused with UNAVAILABLE."""
        return self._closed

    def wake(self) -> None:
        """Make the loop run a step now (new work arrived)."""
        self._wake.set()

    def start(self) -> None:
        """Run the step loop in a background daemon thread (idempotent). Raises RuntimeError
        after :meth:`shutdown`."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} engine was shut down")
            if self._thread is not None:
                return
            self._thread = threading.Thread(
                target=self._loop, name=f"{self.name}-loop", daemon=True
            )
            self._thread.start()

    def is_running(self) -> bool:
        """True while the background step loop thread is alive."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def _loop(self) -> None:
        self._run_loop(self.step, self._wake, "step")

    def _run_loop(self, step: Callable[[], int], wake: threading.Event, what: str) -> None:
        """Call ``step`` until shutdown, waiting on ``wake`` (at most ``idle_poll_s``) after a
        step that computed nothing. A step that raises fails every live request and the loop
        goes on; an injected WorkerKilled ends the loop. ``what`` names the step in logs."""
        while not self._closed:
            wake.clear()  # before looking at the state, so no wake-up is lost
            try:
                computed = step()
            except WorkerKilled:  # an injected in-process crash: the loop dies with the worker
                log.error("%s: %s loop killed by fault injection", self.name, what)
                return
            except Exception as e:  # noqa: BLE001 - a bug: fail what is live, keep serving
                log.exception("%s %s failed", self.name, what)
                self._fail_all(INTERNAL, f"{self.name} {what} failed: {type(e).__name__}: {e}")
                computed = 0
            if computed == 0:
                wake.wait(self.idle_poll_s)

    def run_until_idle(self, timeout_s: float = 60.0) -> int:
        """Step in this thread until :meth:`has_work` is False (for tests and offline use,
        without :meth:`start`). Returns the steps taken. Raises TimeoutError after ``timeout_s``
        seconds."""
        end = time.monotonic() + timeout_s
        steps = 0
        while self.has_work():
            if time.monotonic() > end:
                raise TimeoutError(f"{self.name} engine still busy after {timeout_s} s")
            self._wake.clear()
            steps += 1
            if self.step() == 0 and self.has_work():
                self._wake.wait(0.01)  # only transfers in flight: wait for a completion
        return steps

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop, fail every live request with UNAVAILABLE (freeing its blocks), and
        close the KV transport when this engine built it. Idempotent."""
        with self._lock:
            self._closed = True
            thread, self._thread = self._thread, None
        self._wake.set()
        if thread is not None:
            thread.join(timeout_s)
        self._fail_all(UNAVAILABLE, f"{self.name} is shutting down")
        self._close_transport()

    def _record_step(self, duration_s: float, tokens: int, batch: int) -> None:
        """Count a finished step of ``batch`` sequences in :attr:`num_steps` and the step window
        (lock held)."""
        self.num_steps += 1
        self.window.add(time.monotonic(), duration_s, tokens, batch)
