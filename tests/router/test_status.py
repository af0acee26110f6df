"""The operators' API against fake workers: /v1/cluster/status counters and gauges, request
records (/v1/requests/{id}) for disaggregated, migrated, preempted and unified requests,
x-request-id, and the API key."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fake_workers import FakeCluster, start_fake_cluster
from test_http_gateway import live_server

from pdserve.tokenizer import Tokenizer
from router.background import drain_background
from router.http import build_app
from router.lifecycle import LifecycleConfig
from router.request_id import MAX_REQUEST_ID_CHARS
from router.serving import Router, RouterConfig

pytestmark = pytest.mark.timeout(90)

PROMPT_32 = list(range(100, 132))  # two full KV blocks of 16 tokens
FAKE_BYTES_PER_TOKEN = 100  # what FakePrefill reports per prompt token


@contextlib.asynccontextmanager
async def served(
    tokenizer: Tokenizer,
    prefills: list[dict[str, Any]] | None = None,
    decodes: list[dict[str, Any]] | None = None,
    api_key: str | None = None,
    lifecycle: LifecycleConfig | None = None,
    **cfg: Any,
) -> AsyncIterator[tuple[FakeCluster, Router, httpx.AsyncClient]]:
    """Fake workers, a Router, and its app on a real loopback HTTP server (disconnects are real)."""
    c = await start_fake_cluster(
        prefills=[{}] if prefills is None else prefills, decodes=decodes or [{}]
    )
    router = Router(
        RouterConfig(
            model_name="smollm2",
            max_model_len=512,
            lifecycle=lifecycle or LifecycleConfig(),
            **cfg,
        ),
        tokenizer,
        c.pool,
    )
    app = build_app(router, api_key=api_key)
    try:
        async with (
            live_server(app) as url,
            httpx.AsyncClient(base_url=url, timeout=30) as client,
        ):
            yield c, router, client
    finally:
        await app.state.monitor.stop()
        await drain_background()
        await c.close()


async def status(client: httpx.AsyncClient, **headers: str) -> dict[str, Any]:
    r = await client.get("/v1/cluster/status", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


async def record(client: httpx.AsyncClient, rid: str) -> dict[str, Any]:
    r = await client.get(f"/v1/requests/{rid}")
    assert r.status_code == 200, r.text
    return r.json()


def completion(prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


async def test_counters_match_traffic_and_gauges_return_to_idle(tokenizer: Tokenizer) -> None:
    async with served(
        tokenizer, prefills=[{"delay_s": 0.3}], decodes=[{"step_s": 0.02}], max_queued_requests=1
    ) as (_, _, client):
        baseline = await status(client)
        assert baseline["requests"]["total"] == 0 and baseline["mode"] == "disaggregated"
        assert {w["id"] for w in baseline["workers"]} == {"prefill-0", "decode-0"}
        base_kv = {w["id"]: w["kv_usage"] for w in baseline["workers"]}

        # 1) three finished requests (5 tokens each), one with the client's own x-request-id
        r = await client.post(
            "/v1/completions", json=completion([5, 6, 7], 5), headers={"x-request-id": "mine-1"}
        )
        assert r.status_code == 200 and r.headers["x-request-id"] == "mine-1"
        rs = await asyncio.gather(
            *(client.post("/v1/completions", json=completion([8, 9, 10, 11], 5)) for _ in range(2))
        )
        # the second of these two was refused while the first was queued (max_queued_requests=1)
        codes = sorted(x.status_code for x in rs)
        assert codes == [200, 429], [x.text for x in rs]
        rejected_id = next(x.headers["x-request-id"] for x in rs if x.status_code == 429)
        r2 = await client.post("/v1/completions", json=completion([12, 13], 5))
        assert r2.status_code == 200
        for resp in (r, r2):
            assert resp.headers["x-request-id"]

        # 2) one streamed request whose client leaves after 3 chunks
        body = completion([20, 21, 22], 400, stream=True)
        async with client.stream("POST", "/v1/completions", json=body) as s:
            aborted_id = s.headers["x-request-id"]
            seen = 0
            async for line in s.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break

        # 3) gauges back to idle within 2 s, counters equal to what was sent
        t0 = time.monotonic()
        while True:
            st = await status(client)
            workers = {w["id"]: w for w in st["workers"]}
            idle = (
                st["requests"]["running"] == 0
                and st["requests"]["waiting"] == 0
                and all(w["running"] == 0 and w["waiting"] == 0 for w in workers.values())
                and {k: w["kv_usage"] for k, w in workers.items()} == base_kv
            )
            if idle:
                break
            assert time.monotonic() - t0 < 2.0, f"not idle 2 s after the last request: {st}"
            await asyncio.sleep(0.05)

        req = st["requests"]
        assert req["total"] == 4  # admitted: 3 finished + 1 disconnected (the 429 never was)
        assert req["finished"] == {"length": 3}
        assert req["aborted"] == 1 and req["client_disconnects"] == 1
        assert req["rejected"] == 1 and st["admission"]["rejected"] == 1
        assert st["tokens"]["prompt"] == 3 + 4 + 2 + 3
        aborted = await record(client, aborted_id)
        assert aborted["status"] == "aborted" and aborted["output_tokens"] >= 3
        assert st["tokens"]["generation"] == 15 + aborted["output_tokens"]
        # the disconnected request's KV moved too (its prefill finished), as the workers count it
        assert st["kv_transfers"]["transferred"] == 4
        assert st["kv_transfers"]["bytes"] == FAKE_BYTES_PER_TOKEN * (3 + 4 + 2 + 3)
        lat = st["latency"]
        assert lat["ttft_ms"]["1m"]["count"] == 4 and lat["ttft_ms"]["5m"]["count"] == 4
        assert lat["e2e_ms"]["1m"]["count"] == 3 and lat["tpot_ms"]["1m"]["count"] == 3
        ttft = lat["ttft_ms"]["1m"]
        assert 250 <= ttft["p50"] <= ttft["p99"]  # every prefill took >= 0.3 s
        assert st["throughput"]["output_tokens_per_s"]["1m"] > 0
        assert (await record(client, rejected_id))["status"] == "rejected"
        assert (await record(client, "mine-1"))["status"] == "finished"


async def test_disaggregated_record_names_both_workers_and_kv_bytes(tokenizer: Tokenizer) -> None:
    async with served(tokenizer) as (_, _, client):
        r = await client.post("/v1/completions", json=completion(PROMPT_32, 4))
        assert r.status_code == 200
        rid, response_id = r.headers["x-request-id"], r.json()["id"]
        rec = await record(client, rid)
        assert await record(client, response_id) == rec  # findable by the OpenAI id too
        assert rec["status"] == "finished" and rec["response_ids"] == [response_id]
        (seq,) = rec["sequences"]
        assert seq["prefill_worker"] == "prefill-0" and seq["decode_worker"] == "decode-0"
        assert seq["kv_path"] == "transferred" and seq["finish_reason"] == "length"
        (t,) = seq["transfers"]
        assert (t["prefill_worker"], t["decode_worker"], t["outcome"]) == (
            "prefill-0",
            "decode-0",
            "ok",
        )
        assert t["blocks"] == 2 and t["bytes_per_block"] == 16 * FAKE_BYTES_PER_TOKEN
        assert t["bytes"] == t["blocks"] * t["bytes_per_block"] == seq["kv_bytes_sent"]
        assert seq["cached_tokens"] == 16  # what FakePrefill reports for 32 tokens
        events = [e["event"] for e in seq["timeline"]]
        assert events == [
            "admitted",
            "decode_reserved",
            "prefill_started",
            "prefill_done",
            "kv_transfer",
            "first_token",
            "finished",
        ]
        times = [e["t_ms"] for e in seq["timeline"]]
        assert times == sorted(times)
        assert all(v is not None and v >= 0 for v in seq["phases_ms"].values())

        listed = (await client.get("/v1/requests", params={"limit": 5})).json()["data"]
        assert listed[0]["id"] == rid and listed[0]["kv_path"] == "transferred"
        missing = await client.get("/v1/requests/nope")
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "request_not_found"


async def test_requests_sharing_an_x_request_id_get_records_of_their_own(
    tokenizer: Tokenizer,
) -> None:
    """Two concurrent requests with one x-request-id: each response carries it, each has a
    record of its own (the later under 'twin~2'), each findable by its response id."""
    async with served(tokenizer) as (_, _, client):
        rs = await asyncio.gather(
            *(
                client.post(
                    "/v1/completions",
                    json=completion([5, 6, 7], 4),
                    headers={"x-request-id": "twin"},
                )
                for _ in range(2)
            )
        )
        assert [r.status_code for r in rs] == [200, 200]
        assert [r.headers["x-request-id"] for r in rs] == ["twin", "twin"]
        recs = [await record(client, r.json()["id"]) for r in rs]
        assert sorted(rec["id"] for rec in recs) == ["twin", "twin~2"]
        assert all(rec["request_id"] == "twin" and rec["status"] == "finished" for rec in recs)
        assert all(len(rec["sequences"]) == 1 for rec in recs)
        assert (await record(client, "twin"))["id"] == "twin~2"  # the plain id: the newest


async def test_an_x_request_id_over_the_limit_is_a_400_naming_it(tokenizer: Tokenizer) -> None:
    """An x-request-id of MAX_REQUEST_ID_CHARS is used as is; one character more is a 400 that
    names the header and the limit (answered with an id of the router's), and nothing is
    served or recorded for it."""
    longest = "a" * MAX_REQUEST_ID_CHARS
    async with served(tokenizer) as (c, _, client):
        ok = await client.post(
            "/v1/completions", json=completion([5, 6], 2), headers={"x-request-id": longest}
        )
        assert ok.status_code == 200 and ok.headers["x-request-id"] == longest
        too_long = {"x-request-id": longest + "b"}
        for r in (
            await client.post("/v1/completions", json=completion([5, 6], 2), headers=too_long),
            await client.get("/v1/models", headers=too_long),
        ):
            assert r.status_code == 400, r.text
            assert r.headers["x-request-id"].startswith("req-")
            err = r.json()["error"]
            assert err["param"] == "x-request-id"
            assert err["message"] == (
                f"'x-request-id' is {MAX_REQUEST_ID_CHARS + 1} bytes long; at most "
                f"{MAX_REQUEST_ID_CHARS} are allowed"
            )
        # probes are never refused for it (a proxy's long trace id must not fail liveness)
        for path in ("/health", "/metrics"):
            r = await client.get(path, headers=too_long)
            assert r.status_code == 200 and r.headers["x-request-id"].startswith("req-")
        assert (await status(client))["requests"]["total"] == 1
        assert len(c.prefills[0].requests) == 1


async def test_migrated_request_shows_the_migration_and_its_cause(tokenizer: Tokenizer) -> None:
    decodes = [{"step_s": 0.05}, {"step_s": 0.005}]
    async with served(tokenizer, decodes=decodes) as (c, _, client):
        body = completion([1, 2, 3], 40, stream=True)
        killed = None
        async with client.stream("POST", "/v1/completions", json=body) as s:
            rid = s.headers["x-request-id"]
            seen = 0
            async for line in s.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3 and killed is None:
                    killed = (await record(client, rid))["sequences"][0]["decode_worker"]
                    await c.kill(killed)
        assert killed is not None
        rec = await record(client, rid)
        assert rec["status"] == "finished" and rec["output_tokens"] == 40
        (seq,) = rec["sequences"]
        (mig,) = seq["replacements"]
        assert mig["kind"] == "migration" and mig["worker"] == killed
        assert "stream broke" in mig["cause"] and mig["output_tokens"] >= 3
        assert seq["migrations"] == 1 and seq["decode_worker"] != killed
        events = [e["event"] for e in seq["timeline"]]
        assert events.index("migrated") < len(events) - 1 and events.count("kv_transfer") == 2

        # the router noticed: the status shows the lost worker (the dashboard's banner)
        t0 = time.monotonic()
        while killed not in {w["id"] for w in (await status(client))["lost_workers"]}:
            assert time.monotonic() - t0 < 5, "the lost worker never showed in the status"
            await asyncio.sleep(0.05)
        st = await status(client)
        assert st["requests"]["migrations"] == 1
        assert {w["id"]: w["health"] for w in st["workers"]}[killed] == "unhealthy"


async def test_preempted_request_record_shows_the_cause(tokenizer: Tokenizer) -> None:
    decodes = [{"preempt_budget": 1, "preempt_at": 2}, {}]
    async with served(tokenizer, decodes=decodes) as (_, _, client):
        r = await client.post("/v1/completions", json=completion([1, 2, 3], 6))
        assert r.status_code == 200
        (seq,) = (await record(client, r.headers["x-request-id"]))["sequences"]
        (pre,) = seq["replacements"]
        assert pre["kind"] == "preemption" and pre["cause"] == "injected"
        assert seq["preemptions"] == 1 and len(seq["transfers"]) == 2


async def test_unified_record_shows_no_transfer(tokenizer: Tokenizer) -> None:
    async with served(tokenizer, prefills=[]) as (_, _, client):
        r = await client.post("/v1/completions", json=completion(PROMPT_32, 3))
        assert r.status_code == 200
        rec = await record(client, r.headers["x-request-id"])
        (seq,) = rec["sequences"]
        assert seq["transfers"] == [] and seq["kv_bytes_sent"] == 0
        assert seq["kv_path"] == "local" and rec["kv_path"] == "local"
        assert seq["prefill_worker"] is None and seq["decode_worker"] == "decode-0"
        assert "local_prefill" in [e["event"] for e in seq["timeline"]]
        st = await status(client)
        assert st["mode"] == "unified"
        # the status API counts the local prefill as a 'local' KV path, with no bytes moved
        assert st["kv_transfers"]["local"] == 1 and st["kv_transfers"]["transferred"] == 0
        assert st["kv_transfers"]["bytes"] == 0


async def test_api_key_guards_the_status_api_not_the_page_shell(tokenizer: Tokenizer) -> None:
    async with served(tokenizer, api_key="k3y") as (_, _, client):
        assert (await client.get("/v1/cluster/status")).status_code == 401
        assert (await client.get("/v1/requests/x")).status_code == 401
        assert (await client.get("/v1/cluster/history")).status_code == 401
        st = await status(client, authorization="Bearer k3y")
        assert st["requests"]["total"] == 0
        page = await client.get("/dashboard")
        assert page.status_code == 200 and "uPlot" in page.text
        js = await client.get("/dashboard/static/dashboard.js")
        assert js.status_code == 200 and "sessionStorage" in js.text
        lib = await client.get("/dashboard/static/vendor/uPlot.iife.min.js")
        assert lib.status_code == 200 and len(lib.content) > 10_000
        assert page.headers["x-request-id"].startswith("req-")
        bad = await client.get("/health", headers={"x-request-id": "bad id with spaces"})
        assert bad.headers["x-request-id"].startswith("req-")


async def test_a_worker_not_polled_yet_has_every_common_key() -> None:
    """Right after a scale-up the worker has no stats yet: its entry still has the keys every
    worker's has (null), so a client indexing them does not fail."""
    from pdserve.worker_info import WorkerInfo
    from router.pool import WorkerState
    from router.status import _worker_view
    from router.worker_client import WorkerClient

    for role in ("prefill", "decode"):
        info = WorkerInfo(f"{role}-9", role, "127.0.0.1:1", "", 64, 16)
        client = WorkerClient(info, None)  # a grpc.aio channel: made in the running loop
        view = _worker_view(WorkerState(client=client), None, None)
        await client.close()
        assert view["running"] is None and view["waiting"] is None
        assert view["kv_blocks_total"] == 64 and view["kv_blocks_used"] == 0
