"""The receiver's reservation table and transfer handling, without any transport.

Drives :class:`ReceiverCore` the way a channel thread does (begin -> payload -> finish/abandon)
and checks the NOTE invariant: after cancel() or a failed future, reserved blocks are never
written.
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError

import pytest
import torch
from kv_transfer_kit import deadline_in, layout, make_pool, random_kv

from kv_transfer.base import (
    ChannelClosedError,
    KVTransferError,
    StatsCounter,
    TransferExpiredError,
    TransferOutcome,
    TransferTimeoutError,
)
from kv_transfer.receiver_core import ReceiverCore
from kv_transfer.wire import (
    FLAG_CHECKSUM,
    AckStatus,
    Header,
    MessageKind,
    checksum,
    payload_to_wire,
)
from pdserve.kv_cache.manager import KVCacheManager

pytestmark = pytest.mark.timeout(30)
LAY = layout()


def make_core(num_blocks: int = 32) -> tuple[ReceiverCore, StatsCounter]:
    stats = StatsCounter()
    return ReceiverCore(make_pool(LAY, num_blocks), LAY, stats), stats


def transfer_header(tid: int, kv: torch.Tensor, **kw: int) -> Header:
    n = kv.shape[2]
    return Header(
        kind=MessageKind.TRANSFER,
        transfer_id=tid,
        num_tokens=kw.get("num_tokens", n),
        payload_bytes=kw.get("payload_bytes", n * LAY.bytes_per_token),
        first_token=7,
        first_logprob=-0.75,
    )


def deliver(core: ReceiverCore, header: Header, kv: torch.Tensor) -> AckStatus:
    incoming = core.begin(header)
    return core.finish(incoming, payload_to_wire(kv)).status


def test_expect_validates_its_arguments() -> None:
    core, _ = make_core(num_blocks=8)
    cases = [
        ((-1, [0], deadline_in(5)), "transfer_id must be an int"),
        ((1, [], deadline_in(5)), "at least one block"),
        ((1, [3, 8], deadline_in(5)), r"block_ids \[8\] are outside the pool \[0, 8\)"),
        ((1, [2, 2], deadline_in(5)), "block_ids repeat"),
        ((1, [0], time.time() - 1), "in the past"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            core.expect(*args)
    core.expect(1, [0], deadline_in(5))
    with pytest.raises(ValueError, match="transfer_id 1 is already reserved"):
        core.expect(1, [1], deadline_in(5))
    assert core.pending() == 1
    core.close()


def test_transfer_scatters_and_resolves_the_future() -> None:
    core, stats = make_core()
    fut = core.expect(4, [30, 2, 17], deadline_in(5))
    kv = random_kv(LAY, 40, seed=4)
    assert deliver(core, transfer_header(4, kv), kv) is AckStatus.OK
    res = fut.result(timeout=1)
    assert (res.transfer_id, res.num_tokens, res.block_ids) == (4, 40, (30, 2, 17))
    assert (res.first_token, res.first_logprob) == (7, -0.75)
    assert res.record.outcome is TransferOutcome.OK and res.record.bytes == 40 * 512
    assert torch.equal(core.pool.gather([30, 2, 17], 40), kv)
    assert core.pending() == 0 and stats.snapshot().transfers_ok == 1
    # The same id again: the reservation is consumed, so it is dropped.
    assert deliver(core, transfer_header(4, kv), kv) is AckStatus.NOT_RESERVED


def test_unknown_id_is_dropped_and_nothing_written() -> None:
    core, stats = make_core()
    kv = random_kv(LAY, 5, seed=1)
    assert deliver(core, transfer_header(123, kv), kv) is AckStatus.NOT_RESERVED
    assert torch.count_nonzero(core.pool.kv) == 0
    assert stats.snapshot().transfers_dropped == 1


@pytest.mark.parametrize(
    ("kw", "status", "match"),
    [
        ({"payload_bytes": 40 * 512 - 2}, AckStatus.SIZE_MISMATCH, "needs 512 bytes per token"),
        ({"num_tokens": 49, "payload_bytes": 49 * 512}, AckStatus.TOO_MANY_TOKENS, "exceed"),
    ],
)
def test_bad_sizes_fail_the_reservation(kw: dict[str, int], status: AckStatus, match: str) -> None:
    core, stats = make_core()
    fut = core.expect(9, [1, 2, 3], deadline_in(5))
    kv = random_kv(LAY, kw["payload_bytes"] // 512 + 1, seed=9)
    assert deliver(core, transfer_header(9, kv, **kw), kv) is status
    with pytest.raises(KVTransferError, match=match):
        fut.result(timeout=1)
    assert torch.count_nonzero(core.pool.kv) == 0 and stats.snapshot().transfers_failed == 1


def test_checksum_mismatch_fails_the_reservation() -> None:
    core, _ = make_core()
    fut = core.expect(3, [5], deadline_in(5))
    kv = random_kv(LAY, 16, seed=3)
    wire = payload_to_wire(kv)
    header = Header(
        kind=MessageKind.TRANSFER,
        transfer_id=3,
        num_tokens=16,
        payload_bytes=wire.numel(),
        checksum=checksum(wire) ^ 1,
        flags=FLAG_CHECKSUM,
    )
    assert core.finish(core.begin(header), wire).status is AckStatus.CHECKSUM_MISMATCH
    with pytest.raises(KVTransferError, match="CRC-32"):
        fut.result(timeout=1)
    assert torch.count_nonzero(core.pool.kv) == 0


def test_cancel_while_payload_in_flight_means_no_write() -> None:
    core, stats = make_core()
    fut = core.expect(6, [4, 5], deadline_in(5))
    kv = random_kv(LAY, 20, seed=6)
    incoming = core.begin(transfer_header(6, kv))  # header in, payload on its way
    assert core.cancel(6) and fut.cancelled()
    assert core.finish(incoming, payload_to_wire(kv)).status is AckStatus.NOT_RESERVED
    assert torch.count_nonzero(core.pool.kv) == 0
    s = stats.snapshot()
    assert (s.reservations_cancelled, s.transfers_dropped) == (1, 1)


def test_expiry_while_payload_in_flight_means_no_write() -> None:
    core, _ = make_core()
    fut = core.expect(8, [0], deadline_in(0.2))
    kv = random_kv(LAY, 16, seed=8)
    incoming = core.begin(transfer_header(8, kv))
    with pytest.raises(TransferExpiredError):
        fut.result(timeout=5)
    assert core.finish(incoming, payload_to_wire(kv)).status is AckStatus.NOT_RESERVED
    assert torch.count_nonzero(core.pool.kv) == 0


def test_abandoned_transfer_returns_the_reservation_for_a_retry() -> None:
    core, stats = make_core()
    fut = core.expect(2, [9], deadline_in(5))
    kv = random_kv(LAY, 10, seed=2)
    incoming = core.begin(transfer_header(2, kv))
    core.abandon(incoming, TransferTimeoutError("payload recv timed out"))
    assert not fut.done() and stats.snapshot().transfers_timeout == 1
    assert deliver(core, transfer_header(2, kv), kv) is AckStatus.OK
    assert fut.result(timeout=1).num_tokens == 10


def test_a_second_concurrent_transfer_of_one_id_is_dropped() -> None:
    core, _ = make_core()
    fut = core.expect(5, [1, 2], deadline_in(5))
    kv = random_kv(LAY, 20, seed=5)
    first = core.begin(transfer_header(5, kv))
    assert deliver(core, transfer_header(5, kv), kv) is AckStatus.NOT_RESERVED
    assert core.finish(first, payload_to_wire(kv)).status is AckStatus.OK
    assert fut.result(timeout=1).num_tokens == 20


def test_expired_reservations_free_their_blocks_in_deadline_order() -> None:
    core, stats = make_core(num_blocks=16)
    mgr = KVCacheManager(num_blocks=16, block_size=LAY.block_size)
    order: list[str] = []
    for rid, tid, after in (("a", 1, 0.4), ("b", 2, 0.1), ("c", 3, 0.25)):
        table = mgr.allocate_slots(rid, 33)
        assert table is not None
        fut = core.expect(tid, table, deadline_in(after))

        def on_done(f: object, rid: str = rid) -> None:
            order.append(rid)
            mgr.free(rid)

        fut.add_done_callback(on_done)
    assert mgr.num_free_blocks == 16 - 9
    deadline = time.monotonic() + 5
    while len(order) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert order == ["b", "c", "a"]
    assert mgr.num_free_blocks == 16 and core.pending() == 0
    mgr.check_integrity()
    assert stats.snapshot().reservations_expired == 3


def test_future_callbacks_may_call_back_into_the_receiver() -> None:
    """A done-callback that cancels another reservation must not deadlock."""
    core, _ = make_core()
    other = core.expect(2, [3], deadline_in(5))
    fut = core.expect(1, [1], deadline_in(0.1))
    fut.add_done_callback(lambda f: core.cancel(2))
    with pytest.raises(TransferExpiredError):
        fut.result(timeout=5)
    with pytest.raises(CancelledError):
        other.result(timeout=5)


def test_close_fails_pending_reservations() -> None:
    core, _ = make_core()
    fut = core.expect(1, [1], deadline_in(5))
    core.close()
    with pytest.raises(ChannelClosedError, match="receiver closed"):
        fut.result(timeout=1)
    with pytest.raises(ChannelClosedError, match="closed"):
        core.expect(2, [2], deadline_in(5))
