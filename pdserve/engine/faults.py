"""Fault injection for reliability tests and operators' drills: a :class:`FaultPlan` (what to
break) held by a :class:`FaultInjector` (when, and how many times).

Faults are arguments, never environment variables: tests build a plan and pass the injector to
a worker engine, its gRPC service and its KV sender; a running cluster sets one per worker
through ``POST /admin/faults`` when the router was started with ``--enable-fault-injection``.
Without a plan (the default everywhere) every hook is a no-op.

Faults:

* ``kill_at``: the worker dies at a named phase (:class:`FaultPhase`): the injector calls its
  ``on_kill`` (a real worker exits its process at once, as a crash would; an in-process test
  stops the worker's server). The phases are where a lost worker hurts most: a prefill worker
  holding queued requests, a prefill worker about to send KV, a decode worker mid-stream.
* ``stall_transfer_s``: the KV sender sleeps this long before the next transfer leaves (a
  stalled network); the receiver's reservation lease and the request deadline must cope.
* ``corrupt_payload``: one byte of the next transfer's payload is flipped after its checksum was
  computed; the receiver's CRC-32 check must refuse it (the sender turns its checksum on
  whenever an injector is given, so corruption is never scattered silently).
* ``drop_aborts``: the next N Abort calls a worker receives are answered but not acted on (a
  lost control message); leases must free what they would have freed.
* ``get_stats_delay_s``: GetStats answers after this delay (a slow or partitioned worker).

``count`` bounds how many times the transfer faults fire (stall, corrupt); 0 = every time.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar, cast

log = logging.getLogger(__name__)


class FaultPhase(str, enum.Enum):
    """Named points where ``kill_at`` may strike; each is reached by one worker role only
    (:attr:`role`)."""

    PREFILL_QUEUED = "prefill_queued"  # prefill worker: requests are queued, none computed yet
    KV_SEND = "kv_send"  # prefill worker: a prompt's KV is gathered, about to be sent
    DECODE_RUNNING = "decode_running"  # decode worker: a step with running sequences begins

    @property
    def role(self) -> str:
        """The worker role ('prefill' | 'decode') whose engine reaches this phase."""
        return "decode" if self is FaultPhase.DECODE_RUNNING else "prefill"


def phases_of(role: str) -> list[str]:
    """The ``kill_at`` phases a worker of ``role`` reaches, by name."""
    return [p.value for p in FaultPhase if p.role == role]


# faults the KV sender applies: only prefill workers send KV (a decode worker prefilling
# locally, in unified mode, sends nothing)
_SENDER_FAULTS = ("stall_transfer_s", "corrupt_payload")
# The longest stall or delay a plan may hold (s): a day; time.sleep overflows near 1e308 (an
# adversarial plan was armed and then failed when it fired).
MAX_DELAY_S = 86400.0


class _Tensor(Protocol):
    """What :meth:`FaultInjector.corrupt` needs of a flat ``uint8`` payload (a torch tensor)."""

    def clone(self) -> _Tensor: ...
    def numel(self) -> int: ...
    def __getitem__(self, i: int) -> Any: ...
    def __setitem__(self, i: int, v: Any) -> None: ...


T = TypeVar("T", bound=_Tensor)


@dataclass(frozen=True)
class FaultPlan:
    """What to break (see the module docstring). Times in seconds. The default breaks nothing.

    Raises ValueError on a time that is not a finite number >= 0, a count that is not an
    integer in [0, 2**31), a ``corrupt_payload`` that is not a boolean, or an unknown
    ``kill_at`` phase.
    """

    kill_at: FaultPhase | None = None
    stall_transfer_s: float = 0.0
    corrupt_payload: bool = False
    drop_aborts: int = 0
    get_stats_delay_s: float = 0.0
    count: int = 1

    def __post_init__(self) -> None:
        if self.kill_at is not None and not isinstance(self.kill_at, FaultPhase):
            try:
                object.__setattr__(self, "kill_at", FaultPhase(self.kill_at))
            except ValueError:
                phases = [p.value for p in FaultPhase]
                raise ValueError(f"kill_at must be one of {phases}, got {self.kill_at!r}") from None
        for name in ("stall_transfer_s", "get_stats_delay_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_DELAY_S:
                raise ValueError(
                    f"{name} must be a number of seconds in [0, {MAX_DELAY_S:g}], got {v!r}"
                )
        for name in ("drop_aborts", "count"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**31:
                raise ValueError(f"{name} must be an integer in [0, 2**31), got {v!r}")
        if not isinstance(self.corrupt_payload, bool):
            raise ValueError(f"corrupt_payload must be true or false, got {self.corrupt_payload!r}")

    @property
    def is_empty(self) -> bool:
        return self == FaultPlan()

    def check_role(self, role: str) -> None:
        """Raise ValueError naming the fault when the plan holds one that a worker of ``role``
        never fires: a ``kill_at`` phase of the other role (the message lists ``role``'s
        phases), or a KV transfer fault on a decode worker."""
        if self.kill_at is not None and self.kill_at.role != role:
            raise ValueError(
                f"kill_at {self.kill_at.value!r} is a {self.kill_at.role} worker's phase and "
                f"never fires on a {role} worker; a {role} worker's phases are {phases_of(role)}"
            )
        if role != "prefill":
            for name in _SENDER_FAULTS:
                if getattr(self, name):
                    raise ValueError(
                        f"{name} acts on KV sends, which only prefill workers make; it never "
                        f"fires on a {role} worker"
                    )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FaultPlan:
        """A plan from JSON (the /admin/faults body). Raises ValueError naming an unknown key."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown fault fields {unknown}; known: {sorted(known)}")
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["kill_at"] = self.kill_at.value if self.kill_at is not None else None
        return out


class WorkerKilled(BaseException):
    """Raised by an in-process ``on_kill`` to end the engine's step loop the way a crash ends a
    process (the loop does not catch it as a step failure, and nothing is cleaned up)."""


def exit_process(phase: FaultPhase) -> None:
    """The default ``on_kill``: end this process at once, skipping every cleanup (a crash)."""
    log.error("fault injection: killing this worker at phase %s", phase.value)
    os._exit(1)


class FaultInjector:
    """The hooks workers and the KV sender call; thread-safe.

    ``plan``: the initial plan. ``on_kill``: what ``kill_at`` does (default: exit the process).
    :meth:`set` replaces the plan and resets its budgets.
    """

    def __init__(
        self,
        plan: FaultPlan | None = None,
        on_kill: Callable[[FaultPhase], None] = exit_process,
    ) -> None:
        self._lock = threading.Lock()
        self._on_kill = on_kill
        self.plan = FaultPlan()
        self._transfer_faults = 0
        self._aborts_left = 0
        self.set(plan or FaultPlan())

    def set(self, plan: FaultPlan) -> None:
        with self._lock:
            self.plan = plan
            self._transfer_faults = 0
            self._aborts_left = plan.drop_aborts

    def at(self, phase: FaultPhase) -> None:
        """Kill the worker when the plan says so at ``phase`` (once: the plan is then cleared)."""
        with self._lock:
            if self.plan.kill_at is not phase:
                return
            self.plan = FaultPlan()
        self._on_kill(phase)

    def _transfer_fault(self, wanted: bool) -> bool:
        """Whether a transfer fault fires now (consumes the ``count`` budget); lock held."""
        if not wanted:
            return False
        if self.plan.count and self._transfer_faults >= self.plan.count:
            return False
        self._transfer_faults += 1
        return True

    def transfer_stall_s(self) -> float:
        """Seconds the sender should stall before the next transfer (0 = none)."""
        with self._lock:
            stall = self.plan.stall_transfer_s
            return stall if self._transfer_fault(stall > 0) else 0.0

    def corrupt(self, payload: T) -> T:
        """``payload`` (flat ``uint8``), or a copy with one byte flipped when the plan says so."""
        with self._lock:
            if not self._transfer_fault(self.plan.corrupt_payload) or payload.numel() == 0:
                return payload
        bad = cast(T, payload.clone())
        i = bad.numel() // 2
        bad[i] = bad[i] ^ 0xFF
        log.warning("fault injection: corrupted byte %d of a KV payload", i)
        return bad

    def drop_abort(self) -> bool:
        """True when this Abort must be ignored (consumes the ``drop_aborts`` budget)."""
        with self._lock:
            if self._aborts_left <= 0:
                return False
            self._aborts_left -= 1
            return True

    @property
    def get_stats_delay_s(self) -> float:
        return self.plan.get_stats_delay_s


def abort_unless_dropped(
    faults: FaultInjector | None, abort: Callable[[str], bool], request_id: str
) -> bool:
    """``abort(request_id)``, unless the plan drops this Abort (then False: nothing was done).

    Workers route every abort that comes from the router through here: the Abort RPC and the
    cancellation of the request's own RPC, which are the same control message on the wire.
    """
    if faults is not None and faults.drop_abort():
        log.warning("fault injection: dropped the abort of %s", request_id)
        return False
    return abort(request_id)


async def delay_stats(faults: FaultInjector | None) -> None:
    """Sleep ``get_stats_delay_s`` before GetStats answers (no-op without a plan)."""
    if faults is not None and faults.get_stats_delay_s > 0:
        await asyncio.sleep(faults.get_stats_delay_s)
