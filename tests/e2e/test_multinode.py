"""Multi-node on one machine (issue 11): a Ray head with no CPUs at 127.0.0.1 (router only), a
prefill node at 127.0.0.2 and a decode node at 127.0.0.3, roles placed by custom resources, Ray
token authentication on, an internal token on the workers.

`pdserve serve --ray-address` serves a greedy chat request across the nodes; the output equals
`--mode unified` on the decode node alone; /admin/workers shows each worker at its node's
address; the KV went over a channel between 127.0.0.2 and 127.0.0.3; workers refuse calls
without the internal token; joining as printed works, and a join without Ray's token fails in
one line. The node-failure test (a decode node stopped mid-stream, a second one present) is
``slow``.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections.abc import Iterator

import grpc
import httpx
import pytest
from multinode_kit import LocalCluster, connections_between
from serve_process import ROOT, ServeProcess, metric

from pdserve.auth import INTERNAL_TOKEN_HEADER
from pdserve.v1 import worker_pb2 as wpb
from pdserve.v1 import worker_pb2_grpc as wpb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

INTERNAL = "mn-internal-secret"
PREFILL = {"pdserve_prefill": 1}
DECODE = {"pdserve_decode": 1}
QUESTION = [{"role": "user", "content": "Name three colors of the rainbow."}]
LONG = 96  # tokens of the node-failure stream (ignore_eos): long enough to outlive the kill


def serve_args(cluster: LocalCluster, *extra: str) -> list[str]:
    return [
        "--ray-address", cluster.address,
        "--cpus-per-worker", "1",
        "--dtype", "float32",
        "--prefill-resources", '{"pdserve_prefill": 1}',
        "--decode-resources", '{"pdserve_decode": 1}',
        "--internal-token", INTERNAL,
        *extra,
    ]  # fmt: skip


def chat(url: str, max_tokens: int = 24, **extra: object) -> str:
    body = {
        "model": "smollm2",
        "messages": QUESTION,
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster()
    try:
        c.start_head()
        c.add_node("127.0.0.2", PREFILL)
        c.add_node("127.0.0.3", DECODE)
        yield c
    finally:
        c.stop()


def test_roles_on_their_nodes_equal_unified_and_token_checks(cluster: LocalCluster) -> None:
    srv = ServeProcess(serve_args(cluster), env=cluster.env)
    try:
        try:
            srv.wait_ready(timeout_s=400)
        except RuntimeError as e:
            raise AssertionError(f"{e}\n{cluster.logs()}") from None
        out = srv.output()
        assert f"pdserve router --ray-address {cluster.address}" in out or re.search(
            r"pdserve router --ray-address \S+:\d+", out
        )
        assert INTERNAL not in out and cluster.token not in out  # secrets never logged

        workers = {w["role"]: w for w in httpx.get(f"{srv.url}/admin/workers").json()["workers"]}
        assert workers["prefill"]["node_address"] == "127.0.0.2", workers
        assert workers["prefill"]["grpc_address"].startswith("127.0.0.2:")
        assert workers["decode"]["node_address"] == "127.0.0.3", workers
        assert workers["decode"]["grpc_address"].startswith("127.0.0.3:")
        assert workers["decode"]["kv_endpoint"].startswith("127.0.0.3:")
        assert {w["state"] for w in workers.values()} == {"ready"}

        disaggregated = chat(srv.url)
        assert disaggregated.strip()
        # The KV went prefill -> decode over the pair channel between the two nodes' addresses.
        assert metric(srv.url, "pdserve_kv_transfers_total", 'path="transferred"') >= 1
        assert metric(srv.url, "pdserve_kv_transfer_bytes_total") > 0
        # ... and the pair group's socket joins the two worker processes directly, listening at
        # an advertised node address. NOTE: on one machine the kernel gives a connection to
        # another loopback address the source 127.0.0.1, so the connecting side's end shows
        # 127.0.0.1 rather than its node address; across machines it is the node's IP.
        links = connections_between(workers["prefill"]["pid"], workers["decode"]["pid"])
        assert links, "no connection between the prefill and the decode worker"
        nodes = ("127.0.0.2:", "127.0.0.3:")
        assert any(a.startswith(nodes) or b.startswith(nodes) for a, b in links), links
        stats = _prefill_stats(workers["prefill"]["grpc_address"])
        assert stats.transfer_bytes > 0 and stats.transfer_failures == 0

        _worker_refuses_calls_without_the_token(workers["decode"]["grpc_address"])
        _join_as_printed_serves(cluster, srv)
    finally:
        assert srv.stop() == 0, srv.last_output

    # A join without Ray's token fails in one line (Ray retries ~20 s), while the unified
    # baseline starts on the same cluster: its one decode worker on the 127.0.0.3 node.
    no_token = {k: v for k, v in cluster.env.items() if not k.startswith("RAY_AUTH")}
    no_token["HOME"] = str(cluster.dir)  # no ~/.ray/auth_token of this machine's user either
    joining = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "router", "--ray-address", cluster.address],
        cwd=ROOT, env=no_token, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    unified = ServeProcess(serve_args(cluster, "--mode", "unified"), env=cluster.env)
    try:
        unified.wait_ready(timeout_s=400)
        workers = httpx.get(f"{unified.url}/admin/workers").json()["workers"]
        assert [(w["role"], w["node_address"]) for w in workers] == [("decode", "127.0.0.3")]
        assert chat(unified.url) == disaggregated
    finally:
        assert unified.stop() == 0, unified.last_output
        _, err = joining.communicate(timeout=120)
    assert joining.returncode == 1
    lines = [ln for ln in err.splitlines() if ln.startswith("pdserve router:")]
    assert len(lines) == 1, err
    assert "cannot join the Ray cluster" in lines[0] and "RAY_AUTH_TOKEN" in lines[0], err
    assert "Traceback" not in err


def _prefill_stats(address: str) -> wpb.PrefillStats:
    async def call() -> wpb.PrefillStats:
        async with grpc.aio.insecure_channel(address) as ch:
            return await wpb_grpc.PrefillServiceStub(ch).GetStats(
                wpb.StatsRequest(), timeout=10, metadata=((INTERNAL_TOKEN_HEADER, INTERNAL),)
            )

    return asyncio.run(call())


def _worker_refuses_calls_without_the_token(address: str) -> None:
    async def call(metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = wpb_grpc.DecodeServiceStub(ch)
            try:
                await stub.Abort(wpb.AbortRequest(request_id="x"), timeout=10, metadata=metadata)
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

    assert asyncio.run(call(())) == grpc.StatusCode.UNAUTHENTICATED
    wrong = ((INTERNAL_TOKEN_HEADER, "not-the-token"),)
    assert asyncio.run(call(wrong)) == grpc.StatusCode.UNAUTHENTICATED
    assert asyncio.run(call(((INTERNAL_TOKEN_HEADER, INTERNAL),))) == grpc.StatusCode.OK


def _join_as_printed_serves(cluster: LocalCluster, srv: ServeProcess) -> None:
    """`pdserve router --ray-address ADDRESS` (+ the internal token) joins and serves."""
    router = ServeProcess(
        ["--ray-address", cluster.address, "--internal-token", INTERNAL],
        env=cluster.env,
        command="router",
    )
    try:
        router.wait_ready(timeout_s=300)
        assert chat(router.url, max_tokens=4)
    finally:
        assert router.stop() == 0, router.last_output


# -- node failure -------------------------------------------------------------------------------


@pytest.mark.slow
def test_decode_node_lost_mid_stream_migrates_every_token(cluster: LocalCluster) -> None:
    cluster.add_node("127.0.0.4", DECODE)  # the second decode node
    srv = ServeProcess(serve_args(cluster, "--num-decode-workers", "2"), env=cluster.env)
    try:
        srv.wait_ready(timeout_s=400)
        workers = httpx.get(f"{srv.url}/admin/workers").json()["workers"]
        decode = {w["node_address"]: w for w in workers if w["role"] == "decode"}
        assert set(decode) == {"127.0.0.3", "127.0.0.4"}, workers
        reference = chat(srv.url, max_tokens=LONG, ignore_eos=True)
        migrated_before = metric(srv.url, "pdserve_requests_migrated_total")

        text, victim = _stream_and_stop_its_node(srv.url, cluster, decode)
        assert text == reference
        assert metric(srv.url, "pdserve_requests_migrated_total") - migrated_before == 1
        after = httpx.get(f"{srv.url}/admin/workers").json()["workers"]
        lost = [w for w in after if w["role"] == "decode" and w["node_address"] == victim]
        assert lost and all(w["state"] != "ready" for w in lost), after
        assert chat(srv.url, max_tokens=LONG, ignore_eos=True) == reference  # the survivor serves
    finally:
        assert srv.stop() == 0, srv.last_output


def _stream_and_stop_its_node(
    url: str, cluster: LocalCluster, decode: dict[str, dict]
) -> tuple[str, str]:
    """Stream a greedy chat; after a few tokens, kill (by pid) the processes of the node whose
    decode worker runs it, as a lost machine would. Returns (the stream's text, the node)."""
    body = {
        "model": "smollm2",
        "messages": QUESTION,
        "max_tokens": LONG,
        "temperature": 0,
        "ignore_eos": True,
    }
    pieces: list[str] = []
    victim = ""
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=600
    ) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                pieces.append(choice["delta"].get("content") or "")
            if len(pieces) == 4 and not victim:
                victim = next(
                    node for node, w in decode.items() if _num_running(w["grpc_address"]) > 0
                )
                cluster.nodes[victim].kill(decode[victim]["pid"])
    assert victim, "the stream ended before the node could be stopped"
    return "".join(pieces), victim


def _num_running(address: str) -> int:
    async def call() -> int:
        async with grpc.aio.insecure_channel(address) as ch:
            stats = await wpb_grpc.DecodeServiceStub(ch).GetStats(
                wpb.StatsRequest(), timeout=10, metadata=((INTERNAL_TOKEN_HEADER, INTERNAL),)
            )
            return int(stats.num_running)

    return asyncio.run(call())
