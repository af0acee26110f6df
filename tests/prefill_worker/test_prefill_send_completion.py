"""When a KV send ends, its request resolves at once, not at the next step boundary.

A sender whose transfers the test completes by hand (as a transport's thread would) makes the
timing deterministic: a forward is held open while another request's transfer is acked.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pytest
from prefill_tiny import TINY, prompt, tiny_config

from kv_transfer.base import KVLayout, KVSender, TransferStats
from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.errors import ABORTED, CANCELLED
from pdserve.engine.runner import StepOutput
from pdserve.sampling_params import SamplingParams
from pdserve.types import TransferOutcome, TransferRecord
from prefill_worker.engine import PrefillEngine
from prefill_worker.request import KVTarget, PrefillRequest, PrefillState

pytestmark = pytest.mark.timeout(120)
GREEDY = SamplingParams(temperature=0)
WAIT_S = 30.0  # generous: only a broken engine waits this long


class HeldSender(KVSender):
    """Records each send and leaves its future pending until the test settles it."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.sent: dict[int, Future[TransferRecord]] = {}
        self.arrived = threading.Condition()

    def send(
        self, peer_endpoint: str, transfer_id: int, *rest: object, **kw: object
    ) -> Future[TransferRecord]:
        fut: Future[TransferRecord] = Future()
        with self.arrived:
            self.sent[transfer_id] = fut
            self.arrived.notify_all()
        return fut

    def start(self, transfer_id: int) -> None:
        """The transport's thread takes the transfer off its queue (it can no longer be
        cancelled)."""
        assert self.sent[transfer_id].set_running_or_notify_cancel()

    def ack(self, transfer_id: int, outcome: TransferOutcome = TransferOutcome.OK) -> None:
        """Settle a transfer as its transport's thread would: the receiver acked it."""
        self.sent[transfer_id].set_result(TransferRecord(transfer_id, 1, 1.0, outcome))

    def stats(self) -> TransferStats:
        return TransferStats()

    def close(self) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[tuple[PrefillEngine, HeldSender]]:
    from pdserve.engine.runner import ModelRunner

    config = tiny_config()
    runner = ModelRunner(config, TINY)
    sender = HeldSender(KVLayout.from_pool(runner.kv_pool, TINY.model_id))
    eng = PrefillEngine(config, runner, sender)
    yield eng, sender
    eng.shutdown()


def _req(rid: str, tid: int, seed: int) -> PrefillRequest:
    return PrefillRequest(rid, prompt(20, seed=seed), GREEDY, target=KVTarget(tid, "peer:1"))


def test_acked_request_resolves_during_the_next_forward(
    engine: tuple[PrefillEngine, HeldSender],
) -> None:
    eng, sender = engine
    fa = eng.add_request(_req("a", 1, seed=1))
    eng.step()  # computes a, starts its send
    assert eng.request_state("a") is PrefillState.SENDING and not fa.done()

    # The next step's forward (request b) blocks until the test lets it go.
    in_forward, release = threading.Event(), threading.Event()
    run = eng.runner.run

    def held_run(batch: list[ScheduledSeq]) -> StepOutput:
        in_forward.set()
        assert release.wait(WAIT_S)
        return run(batch)

    eng.runner.run = held_run  # type: ignore[method-assign]
    fb = eng.add_request(_req("b", 2, seed=2))
    stepper = threading.Thread(target=eng.step)
    stepper.start()
    try:
        assert in_forward.wait(WAIT_S)
        sender.ack(1)
        # a's result is out while b's forward is still running.
        result = fa.result(WAIT_S)
        assert stepper.is_alive() and not release.is_set()
        assert result.transfer is not None and result.transfer.outcome is TransferOutcome.OK
        assert eng.request_state("a") is None  # its blocks are freed (kept as prefix cache)
        eng.check_integrity()
    finally:
        release.set()
        stepper.join(WAIT_S)
    with sender.arrived:
        assert sender.arrived.wait_for(lambda: 2 in sender.sent, WAIT_S)
    sender.ack(2)
    assert fb.result(WAIT_S).request_id == "b"
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks and not eng.has_work()


def test_dropped_transfer_fails_the_request_at_once(
    engine: tuple[PrefillEngine, HeldSender],
) -> None:
    eng, sender = engine
    f = eng.add_request(_req("d", 3, seed=3))
    eng.step()
    sender.ack(3, TransferOutcome.DROPPED)
    err = f.exception(WAIT_S)
    assert getattr(err, "code", None) == ABORTED and "dropped" in str(err)
    assert eng.stats().transfer_failures == 1
    eng.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


@pytest.mark.parametrize("on_the_wire", [True, False], ids=["on-the-wire", "queued"])
def test_abort_while_sending_frees_blocks(
    engine: tuple[PrefillEngine, HeldSender], on_the_wire: bool
) -> None:
    """A send on the wire runs to its end and its late ack changes nothing; a send still queued
    (say behind a transfer to a decode worker that died) is cancelled, never reaching the peer."""
    eng, sender = engine
    f = eng.add_request(_req("s", 4, seed=4))
    eng.step()  # computes, samples, starts the send
    assert eng.request_state("s") is PrefillState.SENDING
    if on_the_wire:
        sender.start(4)
    assert eng.abort("s")
    eng.check_integrity()
    assert getattr(f.exception(0), "code", None) == CANCELLED
    assert sender.sent[4].cancelled() is not on_the_wire
    if on_the_wire:
        sender.ack(4)  # the late ack of an aborted request changes nothing
        eng.check_integrity()
    assert eng.stats().num_prefills == 0 and eng.stats().transfer_failures == 0
    assert not eng.has_work() and eng.kv.num_free_blocks == eng.kv.num_blocks


def test_shorter_prompts_kv_is_sent_first_within_a_step(
    engine: tuple[PrefillEngine, HeldSender],
) -> None:
    eng, sender = engine
    big = PrefillRequest("big", prompt(120, seed=5), GREEDY, target=KVTarget(5, "peer:1"))
    futs = [eng.add_request(big), eng.add_request(_req("small", 6, seed=6))]
    eng.step()  # both prompts finish in this step; the later, smaller one is sent first
    assert list(sender.sent) == [6, 5]
    sender.ack(6)
    sender.ack(5)
    assert [f.result(WAIT_S).request_id for f in futs] == ["big", "small"]
