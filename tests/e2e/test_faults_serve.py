"""`pdserve serve` on the bundled SmolLM2 under faults (issue 12 acceptance, single node).

One disaggregated server (1 prefill + 2 decode workers, float32) serves the module:
* its startup: ``/v1/models`` is polled from the moment the port opens and never answers 200
  while a chat request would be refused (503 + Retry-After until then);
* a decode worker killed (SIGKILL, by pid) mid-stream: the greedy 64-token stream continues on
  the other decode worker, token for token equal to the fault-free run, and the metrics count one
  migration;
* a decode worker killed while long prompts bound for it wait on the prefill worker: the router
  sees the broken Decode streams at once, aborts those prefills and re-places them on the other
  decode worker, so no KV transfer is sent to the dead one (before, each such prompt waited out
  the 30 s transfer timeout and then failed its Prefill call), and every answer equals the
  fault-free one.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from serve_process import ServeProcess, metric

from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

CHAT = {
    "model": "smollm2",
    "messages": [{"role": "user", "content": "Tell me about the history of Paris."}],
    "temperature": 0,
}
LONG = 64  # tokens of the stream that outlives its decode worker


@pytest.fixture(scope="module")
def startup() -> Iterator[tuple[ServeProcess, list[tuple[int, int, int]]]]:
    """The server, and what polling from the moment its port opened saw: a list of
    (/health, /v1/models right after, a chat request right after that) statuses."""
    srv = ServeProcess(["--num-decode-workers", "2", "--dtype", "float32"])
    seen: list[tuple[int, int, int]] = []
    try:
        end = time.monotonic() + 600
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            while time.monotonic() < end:
                assert srv.proc.poll() is None, srv.output()
                try:
                    health = http.get("/health")
                except httpx.TransportError:  # the port is not open yet
                    time.sleep(0.05)
                    continue
                # in this order: readiness only grows during startup, so a later call may only
                # see the same answer or a better one
                models = http.get("/v1/models")
                chat = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
                seen.append((health.status_code, models.status_code, chat.status_code))
                for r in (health, models, chat):
                    if r.status_code == 503 and r is not health:
                        assert r.headers.get("retry-after"), (r.url, r.headers)
                if (models.status_code, chat.status_code) == (200, 200):
                    break  # (a worker may register between the two calls: 503 then 200)
                time.sleep(0.2)
        srv.wait_ready(timeout_s=300)
        yield srv, seen
    finally:
        assert srv.stop() == 0, srv.last_output


def test_models_never_200_while_chat_would_be_refused(
    startup: tuple[ServeProcess, list[tuple[int, int, int]]],
) -> None:
    _, seen = startup
    assert seen and seen[-1][1:] == (200, 200), seen
    assert seen[0] == (503, 503, 503), f"the port opened with the workers already up? {seen[:3]}"
    for health, models, chat in seen:
        assert {health, models, chat} <= {200, 503}, seen
        assert not (health == 200 and models == 503), seen  # /health up, /v1/models still not
        assert not (models == 200 and chat == 503), seen  # /v1/models up, chat refused


def _decode_workers(url: str) -> list[dict]:
    workers = httpx.get(f"{url}/admin/workers", timeout=30).json()["workers"]
    return [w for w in workers if w["role"] == "decode" and w["state"] == "ready"]


def _decode_stats(address: str) -> wpb.DecodeStats:
    async def call() -> wpb.DecodeStats:
        async with grpc.aio.insecure_channel(address) as ch:
            return await wpb_grpc.DecodeServiceStub(ch).GetStats(wpb.StatsRequest(), timeout=10)

    return asyncio.run(call())


def _stream(url: str, kill_after: int | None) -> tuple[list[str], dict | None]:
    """Stream a greedy 64-token chat; after ``kill_after`` tokens SIGKILL (by pid) the decode
    worker running it. Returns (the token texts in order, the killed worker)."""
    body = {**CHAT, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    pieces: list[str] = []
    victim = None
    decode = _decode_workers(url)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                pieces.append(choice["delta"].get("content") or "")  # one chunk per token
            if kill_after is not None and victim is None and len(pieces) >= kill_after:
                victim = next(w for w in decode if _decode_stats(w["grpc_address"]).num_running > 0)
                os.kill(victim["pid"], signal.SIGKILL)
    return pieces, victim


def test_decode_worker_killed_mid_stream_float32_identical(
    startup: tuple[ServeProcess, list[tuple[int, int, int]]],
) -> None:
    srv, _ = startup
    assert len(_decode_workers(srv.url)) == 2
    reference, _ = _stream(srv.url, None)
    migrated = metric(srv.url, "pdserve_requests_migrated_total")
    got, victim = _stream(srv.url, kill_after=8)
    assert victim is not None
    assert len(reference) == len(got) == LONG
    assert got == reference
    assert metric(srv.url, "pdserve_requests_migrated_total") - migrated == 1
    usage = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={**CHAT, "max_tokens": LONG, "ignore_eos": True},
        timeout=600,
    ).json()
    assert usage["usage"]["completion_tokens"] == LONG
    assert usage["choices"][0]["message"]["content"] == "".join(reference)  # the survivor serves


WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _long_prompt(i: int) -> str:
    """About 900 tokens (over --max-local-prefill-length's default: it goes to the prefill
    worker), different per ``i`` from the first token on (no shared prefix cache)."""
    return f"Request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(680))


def _completion(i: int) -> dict:
    return {"model": "smollm2", "prompt": _long_prompt(i), "max_tokens": 4, "temperature": 0}


def test_decode_worker_killed_while_its_prompts_queue_on_the_prefill_worker(
    startup: tuple[ServeProcess, list[tuple[int, int, int]]],
) -> None:
    srv, _ = startup
    end = time.monotonic() + 300  # the worker killed above is restarted by Ray
    while len(_decode_workers(srv.url)) < 2:
        assert time.monotonic() < end, "the killed decode worker was not restarted"
        time.sleep(1)
    decode = _decode_workers(srv.url)
    n = 4

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=600) as http:
            calls = [
                asyncio.ensure_future(
                    http.post(
                        "/v1/completions",
                        json=_completion(i),
                        headers={"x-request-id": f"queued-{i}"},
                    )
                )
                for i in range(n)
            ]
            victim: dict = {}
            while not victim:  # a decode worker holding reservations whose KV is not there yet
                await asyncio.sleep(0.2)
                for w in decode:
                    stats = await asyncio.to_thread(_decode_stats, w["grpc_address"])
                    if stats.num_waiting_for_kv:
                        victim = w
                        break
            os.kill(victim["pid"], signal.SIGKILL)
            return list(await asyncio.gather(*calls))

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200] * n, [r.text for r in responses]
    causes = []
    for i in range(n):
        rec = httpx.get(f"{srv.url}/v1/requests/queued-{i}", timeout=30).json()
        for seq in rec["sequences"]:
            assert all(t["outcome"] == "ok" for t in seq["transfers"]), seq["transfers"]
            causes += [r["cause"] for r in seq["replacements"]]
            # only the router's own aborts: no Prefill call failed (a KV send to the dead worker
            # would fail it, after the prompt waited out the transfer timeout)
            failed = [e for e in seq["timeline"] if e["event"] == "prefill_failed"]
            assert all(e["cause"] == "the decode worker was lost" for e in failed), failed
    assert causes and all("during prefill" in c for c in causes), causes
    with httpx.Client(base_url=srv.url, timeout=600) as http:  # fault-free (prefix-cached) runs
        for i, r in enumerate(responses):
            again = http.post("/v1/completions", json=_completion(i)).json()
            assert again["choices"][0]["text"] == r.json()["choices"][0]["text"]
