"""Workers with an internal token (issue 11): on "nodes" 127.0.0.2 (prefill) and 127.0.0.3
(decode), calls without the token are refused with UNAUTHENTICATED and leave no state; the same
calls with the token serve a disaggregated request whose KV handshake carries the token."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grpc
import pytest
from decode_kit import prompt
from test_decode_actor import _config

from decode_worker.actor import DecodeActor
from pdserve.auth import INTERNAL_TOKEN_HEADER
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc
from prefill_worker.actor import PrefillActor

pytestmark = pytest.mark.timeout(120)

TOKEN = "internal-secret-42"
WITH = ((INTERNAL_TOKEN_HEADER, TOKEN),)


async def _code(call: object) -> grpc.StatusCode:
    try:
        await call  # type: ignore[misc]
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def test_calls_without_the_token_are_refused_and_leave_no_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = dataclasses.replace(_config(tmp_path), internal_token=TOKEN)
    assert TOKEN not in repr(config)  # never printed with the config
    decode = DecodeActor("decode-a", config, num_cpus=1)
    prefill = PrefillActor("prefill-a", config, num_cpus=1)
    dinfo = await decode.start(host="127.0.0.3")
    pinfo = await prefill.start(host="127.0.0.2")
    try:
        assert dinfo.grpc_address.startswith("127.0.0.3:") and dinfo.node_address == "127.0.0.3"
        assert dinfo.kv_endpoint.startswith("127.0.0.3:")
        assert pinfo.grpc_address.startswith("127.0.0.2:")
        ids = list(prompt(5, 9))
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=4)
        async with (
            grpc.aio.insecure_channel(dinfo.grpc_address) as dch,
            grpc.aio.insecure_channel(pinfo.grpc_address) as pch,
        ):
            dstub, pstub = pb_grpc.DecodeServiceStub(dch), pb_grpc.PrefillServiceStub(pch)
            req = pb.DecodeRequest(request_id="r1", prompt_token_ids=ids, sampling=sampling)
            for bad in ((), ((INTERNAL_TOKEN_HEADER, "guess"),)):
                stream = dstub.Decode(req, metadata=bad)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stream.read()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                target = pb.KVTarget(transfer_id=1, kv_endpoint=dinfo.kv_endpoint)
                preq = pb.PrefillRequest(
                    request_id="r1", prompt_token_ids=ids, sampling=sampling, target=target
                )
                assert await _code(pstub.Prefill(preq, metadata=bad)) == (
                    grpc.StatusCode.UNAUTHENTICATED
                )
                assert await _code(dstub.GetStats(pb.StatsRequest(), metadata=bad)) == (
                    grpc.StatusCode.UNAUTHENTICATED
                )
            # Nothing was reserved or queued by the refused calls.
            stats = await dstub.GetStats(pb.StatsRequest(), metadata=WITH)
            assert stats.num_running == stats.num_waiting_for_kv == stats.num_waiting == 0
            assert stats.kv_blocks_free == stats.kv_blocks_total
            pstats = await pstub.GetStats(pb.StatsRequest(), metadata=WITH)
            assert pstats.num_waiting == pstats.num_running == pstats.num_prefills == 0
            assert TOKEN not in caplog.text

            # With the token: a whole disaggregated request (KV handshake with the token).
            call = dstub.Decode(req, metadata=WITH)
            acc = (await call.read()).accepted
            resp = await pstub.Prefill(
                pb.PrefillRequest(
                    request_id="r1", prompt_token_ids=ids, sampling=sampling,
                    target=pb.KVTarget(transfer_id=acc.transfer_id, kv_endpoint=acc.kv_endpoint,
                                       decode_worker_id=acc.decode_worker_id),
                ),
                metadata=WITH,
            )  # fmt: skip
            assert resp.transfer.outcome == "ok" and resp.transfer.bytes > 0
            events = []
            while (ev := await call.read()) is not grpc.aio.EOF:
                events.append(ev)
            assert events[-1].WhichOneof("event") == "finished"
    finally:
        await prefill.stop()
        await decode.stop()
