"""PrefillActor without Ray: start serves gRPC on a free port, sets torch threads, stops cleanly."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import grpc
import pytest
import torch
from prefill_tiny import TINY, tiny_config

from pdserve.config import LoadConfig
from pdserve.engine.actor import threads_for
from pdserve.net import node_address
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc as pb_grpc
from prefill_worker.actor import PrefillActor

pytestmark = pytest.mark.timeout(60)


def _model_dir(tmp_path: Path) -> Path:
    cfg = {
        "architectures": [TINY.architecture],
        "vocab_size": TINY.vocab_size,
        "hidden_size": TINY.hidden_size,
        "intermediate_size": TINY.intermediate_size,
        "num_hidden_layers": TINY.num_hidden_layers,
        "num_attention_heads": TINY.num_attention_heads,
        "num_key_value_heads": TINY.num_key_value_heads,
        "head_dim": TINY.head_dim,
        "max_position_embeddings": TINY.max_position_embeddings,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


async def test_actor_start_ping_stop(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    base = tiny_config(num_blocks=40)
    cfg = replace(base, load=LoadConfig(model=str(_model_dir(tmp_path)), load_format="dummy"))
    actor = PrefillActor("prefill-7", cfg, num_cpus=1.0)
    try:
        assert torch.get_num_threads() == 1
        info = await actor.start()
        assert info.role == "prefill" and info.worker_id == "prefill-7"
        assert info.num_blocks == 40 and info.block_size == 16 and info.pid > 0
        # outside Ray: the routed address of this machine, bound and advertised as is
        assert info.node_address == node_address()
        assert info.grpc_address.startswith(f"{info.node_address}:")
        assert await actor.start() == info  # idempotent
        assert await actor.ping()
        async with grpc.aio.insecure_channel(info.grpc_address) as ch:
            st = await pb_grpc.PrefillServiceStub(ch).GetStats(pb.StatsRequest(), timeout=10)
        assert st.worker_id == "prefill-7" and st.kv_blocks_total == 40
    finally:
        await actor.stop()
        torch.set_num_threads(before)
    assert actor.engine is None


def test_threads_follow_the_cpu_share() -> None:
    assert threads_for(0.5) == 1 and threads_for(1.0) == 1 and threads_for(2.0) == 2
    with pytest.raises(ValueError, match="num_cpus"):
        PrefillActor("p", tiny_config(), num_cpus=0)
