"""POST /admin/faults: mounted only with --enable-fault-injection, validates the plan and names
the field at fault (router/http/fault_admin.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_workers import start_fake_cluster

from pdserve.engine.faults import FaultPhase, phases_of
from pdserve.tokenizer import Tokenizer
from router.http import build_app
from router.serving import Router, RouterConfig

pytestmark = pytest.mark.timeout(60)


class Control:
    ROLES = {"decode-0": "decode", "prefill-0": "prefill"}

    def __init__(self) -> None:
        self.armed: dict[str, dict[str, Any]] = {}

    def describe(self) -> list[dict[str, Any]]:
        return [{"worker_id": w, "role": r} for w, r in self.ROLES.items()]

    async def scale(self, role: str, count: int) -> None:
        raise NotImplementedError

    def worker_role(self, worker_id: str) -> str:
        return self.ROLES[worker_id]

    async def set_faults(self, worker_id: str, plan: dict[str, Any]) -> dict[str, Any]:
        self.ROLES[worker_id]  # KeyError for an unknown worker, as the cluster's
        self.armed[worker_id] = plan
        return plan


async def test_fault_admin_only_when_enabled(tokenizer: Tokenizer) -> None:
    c = await start_fake_cluster()
    router = Router(RouterConfig(model_name="smollm2", max_model_len=512), tokenizer, c.pool)
    control = Control()
    body = {"worker_id": "decode-0", "plan": {"kill_at": "decode_running"}}
    try:
        off = build_app(router, control=control)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(off), base_url="http://t") as h:
            assert (await h.post("/admin/faults", json=body)).status_code == 404
        on = build_app(router, api_key="k", control=control, fault_control=control)
        auth = {"Authorization": "Bearer k"}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(on), base_url="http://t") as h:
            assert (await h.post("/admin/faults", json=body)).status_code == 401
            r = await h.post("/admin/faults", json=body, headers=auth)
            assert r.status_code == 200, r.text
            assert r.json()["plan"]["kill_at"] == "decode_running"
            assert control.armed["decode-0"]["kill_at"] == "decode_running"
            for bad, param in [
                ({"worker_id": "decode-9", "plan": {}}, "worker_id"),
                ({"worker_id": "decode-0", "plan": {"explode": 1}}, "plan"),
                ({"worker_id": "decode-0", "plan": {"stall_transfer_s": -1}}, "plan"),
                ({"worker_id": "decode-0", "plan": {"kill_at": "never"}}, "plan"),
            ]:
                r = await h.post("/admin/faults", json=bad, headers=auth)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        await c.close()


@pytest.mark.parametrize(
    ("worker_id", "plan", "says"),
    [
        ("decode-0", {"kill_at": "kv_send"},
         "kill_at 'kv_send' is a prefill worker's phase and never fires on a decode worker; a "
         "decode worker's phases are ['decode_running']"),
        ("prefill-0", {"kill_at": "decode_running"},
         "kill_at 'decode_running' is a decode worker's phase and never fires on a prefill "
         "worker; a prefill worker's phases are ['prefill_queued', 'kv_send']"),
        ("decode-0", {"stall_transfer_s": 2},
         "stall_transfer_s acts on KV sends, which only prefill workers make"),
        ("decode-0", {"corrupt_payload": True}, "corrupt_payload acts on KV sends"),
    ],
)  # fmt: skip
async def test_a_fault_the_role_never_fires_is_refused(
    tokenizer: Tokenizer, worker_id: str, plan: dict[str, Any], says: str
) -> None:
    c = await start_fake_cluster()
    router = Router(RouterConfig(model_name="smollm2", max_model_len=512), tokenizer, c.pool)
    control = Control()
    app = build_app(router, control=control, fault_control=control)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as h:
            r = await h.post("/admin/faults", json={"worker_id": worker_id, "plan": plan})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "plan", err
            assert err["message"].startswith(f"'plan' for {worker_id}: ") and says in err["message"]
            assert control.armed == {}  # nothing was armed
            # each of these plans is armed on a worker of the other role, which fires it
            other = "prefill-0" if worker_id == "decode-0" else "decode-0"
            ok = await h.post("/admin/faults", json={"worker_id": other, "plan": plan})
            assert ok.status_code == 200, ok.text
            assert control.armed == {other: ok.json()["plan"]}
    finally:
        await c.close()


def test_every_phase_belongs_to_the_role_that_reaches_it() -> None:
    """FaultPhase.role matches the engines' calls: prefill_worker/engine.py calls
    ``faults.at`` with the prefill phases, decode_worker/engine.py with the decode one."""
    root = Path(__file__).resolve().parents[2]
    for role in ("prefill", "decode"):
        source = (root / f"{role}_worker" / "engine.py").read_text()
        called = {p.value for p in FaultPhase if f"FaultPhase.{p.name})" in source}
        assert called == set(phases_of(role)), role
