"""DecodeActor without Ray: start/ping/stop, and a real disaggregated request over gRPC with the
KV sent by a PrefillActor over the torch_dist (gloo) transport, equal to the unified result."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from decode_kit import TINY, prompt

from decode_worker.actor import DecodeActor
from pdserve.config import (
    CacheConfig,
    EngineConfig,
    LoadConfig,
    SchedulerConfig,
    TransferConfig,
)
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc
from prefill_worker.actor import PrefillActor

pytestmark = pytest.mark.timeout(120)


def _config(tmp_path: Path) -> EngineConfig:
    cfg = {
        "architectures": [TINY.architecture], "vocab_size": TINY.vocab_size,
        "hidden_size": TINY.hidden_size, "intermediate_size": TINY.intermediate_size,
        "num_hidden_layers": TINY.num_hidden_layers,
        "num_attention_heads": TINY.num_attention_heads,
        "num_key_value_heads": TINY.num_key_value_heads, "head_dim": TINY.head_dim,
        "max_position_embeddings": TINY.max_position_embeddings, "eos_token_id": 127,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return EngineConfig(
        load=LoadConfig(model=str(tmp_path), load_format="dummy", dtype="float32", seed=0),
        cache=CacheConfig(block_size=4, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, max_model_len=256),
        transfer=TransferConfig(backend="torch_dist", timeout_s=20.0),
    )


async def _decode(stub: pb_grpc.DecodeServiceStub, req: pb.DecodeRequest) -> list[pb.DecodeEvent]:
    return [ev async for ev in stub.Decode(req)]


async def test_actor_serves_disaggregated_and_unified(tmp_path: Path) -> None:
    config = _config(tmp_path)
    decode = DecodeActor("decode-7", config, num_cpus=1, allow_local_prefill=True)
    prefill = PrefillActor("prefill-7", config, num_cpus=1)
    assert await decode.ping()  # alive before start
    info = await decode.start()
    try:
        assert info.role == "decode" and info.worker_id == "decode-7"
        assert info.kv_endpoint and info.num_blocks == 64 and info.block_size == 4
        assert await decode.start() is info  # idempotent
        assert await decode.ping()
        pinfo = await prefill.start()
        sampling = pb.SamplingParams(temperature=0.0, max_tokens=6)
        ids = list(prompt(5, 11))
        async with (
            grpc.aio.insecure_channel(info.grpc_address) as dch,
            grpc.aio.insecure_channel(pinfo.grpc_address) as pch,
        ):
            dstub = pb_grpc.DecodeServiceStub(dch)
            pstub = pb_grpc.PrefillServiceStub(pch)
            # Disaggregated: reserve on D, prefill on P with D's KV endpoint as the target.
            call = dstub.Decode(
                pb.DecodeRequest(request_id="d1", prompt_token_ids=ids, sampling=sampling)
            )
            acc = (await call.read()).accepted
            assert acc.kv_endpoint == info.kv_endpoint and acc.decode_worker_id == "decode-7"
            resp = await pstub.Prefill(
                pb.PrefillRequest(
                    request_id="d1", prompt_token_ids=ids, sampling=sampling,
                    target=pb.KVTarget(transfer_id=acc.transfer_id, kv_endpoint=acc.kv_endpoint,
                                       decode_worker_id=acc.decode_worker_id),
                )
            )  # fmt: skip
            assert resp.transfer.outcome == "ok" and resp.transfer.bytes > 0
            rest = []
            while (ev := await call.read()) is not grpc.aio.EOF:
                rest.append(ev)
            assert rest[-1].WhichOneof("event") == "finished"
            disagg = [resp.token.token_id] + [
                t.token_id for ev in rest[:-1] for t in ev.tokens.tokens
            ]
            # Unified on the same worker.
            local = pb.DecodeRequest(
                request_id="u1", prompt_token_ids=ids, sampling=sampling, prefill_locally=True
            )
            events = await _decode(dstub, local)
            unified = [t.token_id for ev in events[1:-1] for t in ev.tokens.tokens]
            assert disagg == unified and len(unified) == rest[-1].finished.num_output_tokens
            stats = await dstub.GetStats(pb.StatsRequest())
            assert stats.kv_endpoint == info.kv_endpoint and stats.num_finished == 2
            assert stats.kv_blocks_free == stats.kv_blocks_total == 64
    finally:
        await prefill.stop()
        await decode.stop()
    assert decode.engine is None


def test_bad_cpu_share(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_cpus"):
        DecodeActor("d", _config(tmp_path), num_cpus=0)
