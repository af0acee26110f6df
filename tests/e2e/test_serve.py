"""`pdserve serve` on the bundled SmolLM2, driven as a user would: OpenAI client, gRPC stub, curl-
style errors, a disconnecting client, and the unified baseline (issue 6 acceptance).

One disaggregated server (1 prefill + 1 decode worker, API key from PDSERVE_API_KEY) serves the
whole module; the unified comparison starts a second, unified server at the end.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_process import PROMPTS, ServeProcess

from pdserve.tokenizer import Tokenizer, load_tokenizer
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

KEY = "e2e-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServeProcess]:
    # float32: the unified comparison below wants greedy tokens equal across two servers whose
    # batches differ; in bf16 a near tie flips with the batch's rounding (seen once in CI-like runs)
    srv = ServeProcess(["--dtype", "float32"], env={"PDSERVE_API_KEY": KEY})
    try:
        srv.wait_ready()
        yield srv
    finally:
        assert srv.stop() == 0, srv.last_output
        # GRPC_ENABLE_FORK_SUPPORT=0 for our processes: no fork-handler log spam
        assert "calling into gRPC, skipping fork()" not in srv.last_output


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer("smollm2")


def test_openai_client_chat_streamed_and_concurrent(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="smollm2", messages=QUESTION, max_tokens=24, temperature=0
    )
    text = r.choices[0].message.content or ""
    assert "Paris" in text
    assert r.usage is not None and r.usage.completion_tokens > 0

    stream = client.chat.completions.create(
        model="smollm2",
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces, finishes, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finishes.append(c.finish_reason)
    assert "".join(pieces) == text
    assert all(f is None for f in finishes[:-1]) and finishes[-1] in ("stop", "length")
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens

    async def many() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=client.base_url, api_key=KEY, max_retries=0)
        rs = await asyncio.gather(
            *(
                aclient.chat.completions.create(
                    model="smollm2",
                    messages=[{"role": "user", "content": f"Say a word about number {i}."}],
                    max_tokens=8,
                    temperature=0,
                )
                for i in range(16)
            )
        )
        return [x.choices[0].finish_reason for x in rs]

    assert all(f in ("stop", "length") for f in asyncio.run(many()))


def test_grpc_streams_the_same_tokens_and_reports_serving(
    server: ServeProcess, client: openai.OpenAI, tokenizer: Tokenizer
) -> None:
    http = client.completions.create(
        model="smollm2", prompt=PROMPTS[0], max_tokens=12, temperature=0, logprobs=0
    )
    assert http.choices[0].logprobs is not None
    http_tokens = http.choices[0].logprobs.tokens

    async def via_grpc() -> tuple[list[int], str, int]:
        async with grpc.aio.insecure_channel(server.grpc_address) as ch:
            health = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            req = gpb.GenerateRequest(
                text=PROMPTS[0], sampling=cpb.SamplingParams(max_tokens=12, temperature=0)
            )
            stub = gpb_grpc.GenerationStub(ch)
            # The server has an API key: the gRPC API refuses a call without it (issue 11).
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                _ = [r async for r in stub.Generate(req)]
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            ids: list[int] = []
            text = ""
            async for r in stub.Generate(req, metadata=(("authorization", f"Bearer {KEY}"),)):
                if r.WhichOneof("response") == "chunk":
                    ids += [t.token_id for t in r.chunk.tokens]
                elif r.WhichOneof("response") == "complete":
                    text = r.complete.text
            return ids, text, health.status

    ids, text, status = asyncio.run(via_grpc())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert [tokenizer.decode([i], skip_special_tokens=False) for i in ids] == http_tokens
    assert text == http.choices[0].text


def test_api_key_bad_input_and_recovery(server: ServeProcess, client: openai.OpenAI) -> None:
    chat = f"{server.url}/v1/chat/completions"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    ok = {"messages": QUESTION, "max_tokens": 4}
    bad = [
        ({"messages": QUESTION, "max_tokens": "ten"}, 400),
        ({"messages": QUESTION, "max_tokens": 0}, 400),
        ({"messages": QUESTION, "max_tokens": -5}, 400),
        ({"messages": QUESTION, "n": 0}, 400),
        ({"messages": "hello"}, 400),
        ({"messages": QUESTION, "temperature": "hot"}, 400),
        ({"model": "nope", "messages": QUESTION}, 404),
    ]
    for body, status in bad:
        r = httpx.post(chat, json=body, headers=AUTH, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(chat, content=b"{not json", headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    long = [{"role": "user", "content": "hello " * 3000}]
    r = httpx.post(chat, json={"messages": long, "max_tokens": 8}, headers=AUTH, timeout=30)
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="smollm2", prompt="hi", max_tokens=2048)
    r = httpx.post(chat, json=ok, headers=AUTH, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_disconnect_frees_kv_on_both_workers_within_2s(server: ServeProcess) -> None:
    workers = httpx.get(f"{server.url}/admin/workers", headers=AUTH).json()["workers"]
    assert {w["role"] for w in workers} == {"prefill", "decode"}

    async def stats() -> list[wpb.PrefillStats | wpb.DecodeStats]:
        out = []
        for w in workers:
            async with grpc.aio.insecure_channel(w["grpc_address"]) as ch:
                if w["role"] == "prefill":
                    out.append(await wpb_grpc.PrefillServiceStub(ch).GetStats(wpb.StatsRequest()))
                else:
                    out.append(await wpb_grpc.DecodeServiceStub(ch).GetStats(wpb.StatsRequest()))
        return out

    def idle(s: wpb.PrefillStats | wpb.DecodeStats) -> bool:
        if isinstance(s, wpb.DecodeStats):
            return (
                s.num_running == 0
                and s.num_waiting_for_kv == 0
                and s.num_waiting == 0
                and s.kv_blocks_free == s.kv_blocks_total
            )
        return s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_used == 0

    body = {
        "prompt": "Tell me a long story.",
        "max_tokens": 1000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 5:
                # NOTE: checked while the line iterator is still open: leaving the loop drops it,
                # which closes the connection, and the server may then free everything before a
                # check made after the loop (a CI failure: all idle at "it was running")
                assert not all(idle(s) for s in asyncio.run(stats()))  # it is running
                break
        assert seen == 5
    t0 = time.monotonic()
    while True:
        current = asyncio.run(stats())
        if all(idle(s) for s in current):
            break
        assert time.monotonic() - t0 < 2.0, f"workers still busy 2 s after disconnect: {current}"
        time.sleep(0.05)


# SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64. K and V of one 16-token block, in bytes, for
# the dtypes `--dtype auto` picks on a CPU (float32, or bfloat16 where bf16 beats fp32).
SMOLLM2_BLOCK_BYTES = {"float32": 2 * 30 * 3 * 64 * 16 * 4, "bfloat16": 2 * 30 * 3 * 64 * 16 * 2}
KV_CACHE_BYTES = 256 * 1024 * 1024  # --kv-cache-memory-bytes of serve_process.SMALL


def test_status_api_and_kv_handoff_record(server: ServeProcess) -> None:
    """Issue 14 on the real model: the status API counts one more request, returns to idle, and
    the request's record names both workers and KV bytes = blocks x block bytes."""
    before = httpx.get(f"{server.url}/v1/cluster/status", headers=AUTH, timeout=30).json()
    prompt = list(range(1000, 1032))  # 32 tokens = 2 full KV blocks
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True},
        headers={**AUTH, "x-request-id": "e2e-kv-record"},
        timeout=120,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "e2e-kv-record"
    rec = httpx.get(f"{server.url}/v1/requests/e2e-kv-record", headers=AUTH, timeout=30).json()
    (seq,) = rec["sequences"]
    assert seq["prefill_worker"].startswith("prefill") and seq["decode_worker"].startswith("decode")
    (t,) = seq["transfers"]
    assert t["path"] == "transferred" and t["outcome"] == "ok" and t["blocks"] == 2
    block_bytes = t["bytes_per_block"]
    assert block_bytes in SMOLLM2_BLOCK_BYTES.values()
    assert t["bytes"] == t["blocks"] * block_bytes == seq["kv_bytes_sent"]
    assert (
        t["prefill_worker"] == seq["prefill_worker"] and t["decode_worker"] == seq["decode_worker"]
    )
    assert seq["output_tokens"] == 8 and seq["finish_reason"] == "length"

    t0 = time.monotonic()
    while True:
        st = httpx.get(f"{server.url}/v1/cluster/status", headers=AUTH, timeout=30).json()
        busy = [w for w in st["workers"] if w["running"] or w["waiting"] or w["kv_usage"] > 0.9]
        if st["requests"]["running"] == 0 and st["requests"]["waiting"] == 0 and not busy:
            break
        assert time.monotonic() - t0 < 2.0, f"status not idle 2 s after the request: {st}"
        time.sleep(0.05)
    assert st["requests"]["total"] == before["requests"]["total"] + 1
    finished = st["requests"]["finished"].get("length", 0)
    assert finished == before["requests"]["finished"].get("length", 0) + 1
    assert st["kv_transfers"]["bytes"] == before["kv_transfers"]["bytes"] + t["bytes"]
    workers = {w["role"]: w for w in st["workers"]}
    assert workers["prefill"]["kv_bytes_sent"] >= t["bytes"]
    assert workers["decode"]["kv_bytes_received"] >= t["bytes"]
    assert workers["decode"]["restarts"] == 0 and workers["decode"]["health"] == "healthy"
    # the workers sized their pools with the same block bytes: memory // block bytes
    assert workers["decode"]["kv_blocks_total"] == KV_CACHE_BYTES // block_bytes
    assert httpx.get(f"{server.url}/v1/cluster/status", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/dashboard", timeout=30).status_code == 200


def test_unified_server_matches_disaggregated_greedy(client: openai.OpenAI) -> None:
    def outputs(c: openai.OpenAI) -> list[str]:
        r = c.completions.create(model="smollm2", prompt=PROMPTS, max_tokens=16, temperature=0)
        return [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]

    disaggregated = outputs(client)
    unified = ServeProcess(["--mode", "unified", "--dtype", "float32"])
    try:
        unified.wait_ready()
        uclient = openai.OpenAI(base_url=f"{unified.url}/v1", api_key="none", max_retries=0)
        assert outputs(uclient) == disaggregated
        r = httpx.post(
            f"{unified.url}/v1/completions",
            json={"prompt": list(range(1000, 1032)), "max_tokens": 2},
            timeout=120,
        )
        rec = httpx.get(f"{unified.url}/v1/requests/{r.headers['x-request-id']}").json()
        (seq,) = rec["sequences"]  # a unified request: KV computed where it is used
        assert (
            seq["transfers"] == [] and seq["kv_path"] == "local" and seq["prefill_worker"] is None
        )
    finally:
        # SIGTERM (what a process manager sends) stops as cleanly as Ctrl-C: no Ray stack dump
        assert unified.stop(sig=signal.SIGTERM) == 0, unified.last_output
        assert "SIGTERM received" not in unified.last_output, unified.last_output
        assert "[pdserve] stopped" in unified.last_output
