"""POST /admin/faults: mounted only with --enable-fault-injection, validates the plan and names
the field at fault (router/http/fault_admin.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from fake_workers import start_fake_cluster

from pdserve.tokenizer import Tokenizer
from router.http import build_app
from router.serving import Router, RouterConfig

pytestmark = pytest.mark.timeout(60)


class Control:
    def __init__(self) -> None:
        self.armed: dict[str, dict[str, Any]] = {}

    def describe(self) -> list[dict[str, Any]]:
        return [{"worker_id": "decode-0"}]

    async def scale(self, role: str, count: int) -> None:
        raise NotImplementedError

    async def set_faults(self, worker_id: str, plan: dict[str, Any]) -> dict[str, Any]:
        if worker_id != "decode-0":
            raise KeyError(worker_id)
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
