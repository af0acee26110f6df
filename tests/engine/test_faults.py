"""FaultPlan validation and the FaultInjector's budgets (pdserve/engine/faults.py)."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import make_sender
from kv_transfer.base import KVLayout
from pdserve.config import TransferConfig
from pdserve.engine.faults import (
    FaultInjector,
    FaultPhase,
    FaultPlan,
    WorkerKilled,
    abort_unless_dropped,
)

pytestmark = pytest.mark.timeout(30)


def test_plan_from_dict_round_trips_and_names_bad_fields() -> None:
    plan = FaultPlan.from_dict({"kill_at": "kv_send", "stall_transfer_s": 2.5, "count": 0})
    assert plan.kill_at is FaultPhase.KV_SEND
    assert FaultPlan.from_dict(plan.to_dict()) == plan
    assert FaultPlan().is_empty and not plan.is_empty
    with pytest.raises(ValueError, match="unknown fault fields \\['explode'\\]"):
        FaultPlan.from_dict({"explode": True})
    with pytest.raises(ValueError, match="kill_at must be one of"):
        FaultPlan(kill_at="later")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stall_transfer_s must be a number of seconds in"):
        FaultPlan(stall_transfer_s=-1)
    with pytest.raises(ValueError, match="drop_aborts must be an integer"):
        FaultPlan(drop_aborts=-1)
    # JSON of the wrong type or range (the fault tester's bodies): a message, no Python text
    for bad, says in (
        ({"count": 1.5}, "count must be an integer"),
        ({"count": "x"}, "count must be an integer"),
        ({"drop_aborts": 2**70}, "drop_aborts must be an integer in"),
        ({"stall_transfer_s": float("inf")}, "stall_transfer_s must be a number of seconds"),
        # armed, it would overflow time.sleep when it fired (adversarial pass, session 40)
        (
            {"stall_transfer_s": 1e308},
            "stall_transfer_s must be a number of seconds in \\[0, 86400\\]",
        ),
        ({"get_stats_delay_s": 86400.5}, "get_stats_delay_s must be a number of seconds"),
        ({"corrupt_payload": "yes"}, "corrupt_payload must be true or false"),
    ):
        with pytest.raises(ValueError, match=says):
            FaultPlan.from_dict(bad)


def test_kill_fires_once_at_its_phase() -> None:
    seen: list[FaultPhase] = []

    def on_kill(phase: FaultPhase) -> None:
        seen.append(phase)
        raise WorkerKilled(phase.value)

    f = FaultInjector(FaultPlan(kill_at=FaultPhase.KV_SEND), on_kill=on_kill)
    f.at(FaultPhase.PREFILL_QUEUED)  # another phase: nothing
    with pytest.raises(WorkerKilled):
        f.at(FaultPhase.KV_SEND)
    f.at(FaultPhase.KV_SEND)  # the plan is spent
    assert seen == [FaultPhase.KV_SEND]


def test_transfer_fault_budget_and_corruption() -> None:
    f = FaultInjector(FaultPlan(stall_transfer_s=1.5, corrupt_payload=True, count=2))
    payload = torch.arange(16, dtype=torch.uint8)
    bad = f.corrupt(payload)
    assert bad is not payload and int((bad != payload).sum()) == 1
    assert f.transfer_stall_s() == 1.5  # the second of count=2
    assert f.transfer_stall_s() == 0.0 and f.corrupt(payload) is payload  # budget spent
    f.set(FaultPlan(stall_transfer_s=1.0, count=0))  # 0 = every time
    assert [f.transfer_stall_s() for _ in range(3)] == [1.0, 1.0, 1.0]


def test_dropped_aborts_and_stats_delay() -> None:
    aborted: list[str] = []

    def abort(rid: str) -> bool:
        aborted.append(rid)
        return True

    f = FaultInjector(FaultPlan(drop_aborts=1, get_stats_delay_s=0.5))
    assert abort_unless_dropped(f, abort, "a") is False  # dropped
    assert abort_unless_dropped(f, abort, "b") is True
    assert abort_unless_dropped(None, abort, "c") is True
    assert aborted == ["b", "c"] and f.get_stats_delay_s == 0.5


def test_a_sender_with_an_injector_always_checksums() -> None:
    layout = KVLayout("m", "float32", 1, 1, 4, 4)
    cfg = TransferConfig(backend="loopback", checksum=False)
    plain = make_sender(cfg, layout)
    armed = make_sender(cfg, layout, faults=FaultInjector())
    try:
        assert plain.checksum is False  # type: ignore[attr-defined]
        assert armed.checksum is True  # type: ignore[attr-defined]
    finally:
        plain.close()
        armed.close()
