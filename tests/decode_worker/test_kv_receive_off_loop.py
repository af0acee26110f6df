"""A KV transfer arriving at a decode worker never holds up its step loop.

The scatter of a received payload into the pool is held open by the test until the decode loop
has completed several more steps of an already running sequence: that can only happen when the
receive and scatter run off the loop thread and take no lock the loop needs. Counting steps (not
timing them) keeps the check meaningful on a loaded 2-core machine. Both transports: loopback
(the sender's thread delivers) and torch_dist over gloo on 127.0.0.1 (the receiver's channel
thread receives and scatters).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch
from decode_kit import TINY, Collector, greedy, prompt, tiny_config

from decode_worker.engine import DecodeEngine
from decode_worker.request import DecodeRequest, FinishedEvent
from kv_transfer import make_receiver, make_sender
from kv_transfer.base import KVLayout
from pdserve.config import TransferConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.runner import ModelRunner, StepOutput

pytestmark = pytest.mark.timeout(120)
STEPS_DURING_SCATTER = 3
STEP_S = 0.02  # a floor on each step's time, so the running sequence outlives the transfer
WAIT_S = 30.0


@pytest.mark.parametrize("backend", ["loopback", "torch_dist"])
def test_decode_loop_keeps_stepping_while_a_transfer_is_scattered(backend: str) -> None:
    config = tiny_config(max_model_len=256)
    runner = ModelRunner(config, TINY)
    pool = runner.kv_pool
    layout = KVLayout.from_pool(pool, TINY.model_id)
    transfer = TransferConfig(backend=backend, timeout_s=WAIT_S)
    receiver = make_receiver(transfer, pool, layout)
    engine = DecodeEngine(config, runner=runner, receiver=receiver)
    sender = make_sender(transfer, layout)

    run = runner.run

    def paced_run(batch: list[ScheduledSeq]) -> StepOutput:
        time.sleep(STEP_S)
        return run(batch)

    runner.run = paced_run  # type: ignore[method-assign]

    scatter = pool.scatter
    seen: dict[str, str | int] = {}

    def held_scatter(block_ids: Sequence[int], kv: torch.Tensor) -> None:
        seen["thread"] = threading.current_thread().name
        start = engine.num_steps
        end = time.monotonic() + WAIT_S
        while engine.num_steps < start + STEPS_DURING_SCATTER and time.monotonic() < end:
            time.sleep(0.005)
        seen["steps"] = engine.num_steps - start
        scatter(block_ids, kv)

    pool.scatter = held_scatter  # type: ignore[method-assign]

    col = Collector()
    engine.start()
    try:
        # A local request decodes for the whole test (up to max_model_len).
        local = DecodeRequest(
            "local", prompt(1, 8), greedy(240, ignore_eos=True), prefill_locally=True
        )
        engine.add_request(local, col.sink("local"))
        remote_prompt = prompt(2, 100)
        remote = DecodeRequest("remote", remote_prompt, greedy(4, ignore_eos=True))
        accepted = engine.add_request(remote, col.sink("remote"))
        kv = torch.randn(layout.payload_shape(len(remote_prompt)))
        fut = sender.send(accepted.kv_endpoint, accepted.transfer_id, kv, first_token=5)
        assert fut.result(WAIT_S).outcome.value == "ok"
        col.wait(["remote"], WAIT_S)
        assert seen["thread"] != f"{engine.name}-loop"
        steps = seen["steps"]
        assert isinstance(steps, int) and steps >= STEPS_DURING_SCATTER  # stepped meanwhile
        assert not col.done("local")  # ... for the running sequence
        assert isinstance(col.last("remote"), FinishedEvent)
        engine.abort("local")
    finally:
        sender.close()
        engine.shutdown()
        receiver.close()
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
