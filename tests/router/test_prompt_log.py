"""Prompts and outputs never reach the logs unless --log-prompts is given (issue 12).

A request carries a unique marker in its prompt and the fake workers echo it into the output; every
log record of every logger (DEBUG and up, formatted with its arguments) is captured while the
request runs, over HTTP (streaming and not) and gRPC.
"""

from __future__ import annotations

import logging
import uuid

import grpc
import pytest
from fake_workers import EOS
from test_http_gateway import env

from pdserve.tokenizer import Tokenizer
from pdserve.v1 import common_pb2 as cpb
from pdserve.v1 import generate_pb2 as gpb
from pdserve.v1 import generate_pb2_grpc as gpb_grpc
from router.grpc_gateway import GrpcGateway
from router.serving import Router

pytestmark = pytest.mark.timeout(60)


async def _requests(router: Router, client, marker: str) -> str:  # type: ignore[no-untyped-def]
    """Send the marker through every API; returns the output text of the chat request."""
    msgs = [{"role": "user", "content": f"remember {marker}"}]
    r = await client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 40})
    assert r.status_code == 200, r.text
    output = r.json()["choices"][0]["message"]["content"]
    body = {"prompt": f"say {marker}", "max_tokens": 40, "stream": True}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]")
    gw = GrpcGateway(router, host="127.0.0.1", port=0)
    await gw.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.port}") as ch:
            stub = gpb_grpc.GenerationStub(ch)
            req = gpb.GenerateRequest(
                text=f"grpc {marker}", sampling=cpb.SamplingParams(max_tokens=40)
            )
            _ = [m async for m in stub.Generate(req)]
    finally:
        await gw.stop(0.1)
    return output


@pytest.mark.parametrize("log_prompts", [False, True])
async def test_prompts_and_outputs_logged_only_with_log_prompts(
    tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture, log_prompts: bool
) -> None:
    marker = f"zq{uuid.uuid4().hex[:12]}"
    # the fake workers answer with the marker's tokens: an output containing it
    script = tokenizer.encode(f" {marker} done", add_special_tokens=False) + [EOS]
    decode = {"script": script}
    async with env(tokenizer, decode=decode, log_prompts=log_prompts) as e:
        e.cluster.prefills[0].script = script
        with caplog.at_level(logging.DEBUG):
            output = await _requests(e.router, e.client, marker)
    assert marker in output
    logged = "\n".join(r.getMessage() for r in caplog.records)
    if log_prompts:
        assert f"remember {marker}" in logged and f"grpc {marker}" in logged  # prompts
        assert f"{marker} done" in logged  # outputs
    else:
        assert marker not in logged
        assert caplog.records, "nothing was captured: the check would prove nothing"
