"""The loopback backend and the shared sender queue (argument checks, order, failures)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from kv_transfer_kit import deadline_in, layout, make_pool, random_kv, scattered_blocks

from kv_transfer.base import ChannelClosedError, LayoutMismatchError, TransferOutcome
from kv_transfer.loopback import LoopbackReceiver, LoopbackSender
from pdserve.kv_cache.pool import KVPool

pytestmark = pytest.mark.timeout(30)


Pair = tuple[LoopbackReceiver, LoopbackSender, KVPool]


@pytest.fixture
def pair() -> Iterator[Pair]:
    lay = layout("bfloat16")
    pool = make_pool(lay, 256)
    rx = LoopbackReceiver(pool, lay)
    tx = LoopbackSender(lay, timeout_s=5.0, checksum=True)
    yield rx, tx, pool
    tx.close()
    rx.close()


def test_bit_exact_transfer_and_records(pair: Pair) -> None:
    rx, tx, pool = pair
    for n in (1, 17, 1000):
        blocks = scattered_blocks(n, 256, seed=n)
        fut = rx.expect(n, blocks, deadline_in(5))
        kv = random_kv(tx.layout, n, seed=n)
        rec = tx.send(rx.endpoint, n, kv, n + 1, -0.125).result(timeout=5)
        assert (rec.outcome, rec.bytes, rec.path) == (TransferOutcome.OK, kv.nbytes, "transferred")
        res = fut.result(timeout=5)
        assert (res.first_token, res.first_logprob, res.num_tokens) == (n + 1, -0.125, n)
        assert torch.equal(pool.gather(blocks, n), kv)
    assert tx.stats().transfers_ok == 3 and rx.stats().transfers_ok == 3


def test_one_peer_transfers_complete_in_send_order(pair: Pair) -> None:
    rx, tx, _ = pair
    done: list[int] = []  # appended by the peer's thread, one transfer at a time
    futs = []
    for tid in range(40):
        rx.expect(tid, [tid], deadline_in(10))
        f = tx.send(rx.endpoint, tid, random_kv(tx.layout, 16, seed=tid), 0)
        f.add_done_callback(lambda _f, tid=tid: done.append(tid))
        futs.append(f)
    assert all(f.result(timeout=10).outcome is TransferOutcome.OK for f in futs)
    assert done == list(range(40))


def test_a_cancelled_queued_send_is_skipped(pair: Pair) -> None:
    rx, tx, _ = pair
    hold = threading.Event()
    for tid in (1, 2, 3):
        rx.expect(tid, [tid], deadline_in(10))
    connect = tx._connect

    def slow_connect(peer: str) -> Any:  # holds the peer's thread inside the first transfer
        assert hold.wait(10)
        return connect(peer)

    tx._connect = slow_connect  # type: ignore[method-assign]
    first = tx.send(rx.endpoint, 1, random_kv(tx.layout, 16, seed=1), 0)
    queued = tx.send(rx.endpoint, 2, random_kv(tx.layout, 16, seed=2), 0)  # behind the first
    assert queued.cancel()
    hold.set()
    last = tx.send(rx.endpoint, 3, random_kv(tx.layout, 16, seed=3), 0)
    assert first.result(timeout=5).outcome is TransferOutcome.OK
    assert last.result(timeout=5).outcome is TransferOutcome.OK
    assert queued.cancelled()
    assert tx.stats().transfers_ok == 2 and rx.stats().transfers_ok == 2  # 2 never left


def test_send_rejects_bad_arguments_naming_them(pair: Pair) -> None:
    rx, tx, _ = pair
    lay = tx.layout
    good = random_kv(lay, 4, seed=0)
    cases = [
        (dict(kv=good[:, :, :, :1]), r"num_kv_heads=2.*got \[2, 2, 4, 1, 16\]"),
        (dict(kv=good[:, :, :0]), "num_tokens>=1"),
        (dict(kv=good.float()), "dtype torch.float32 != layout dtype bfloat16"),
        (dict(transfer_id=-5), "transfer_id must be an int"),
        (dict(peer_endpoint=""), "peer_endpoint must be a non-empty"),
        (dict(first_token=1.5), "first_token must be an int"),
        (dict(first_logprob=float("nan")), "first_logprob is NaN"),
    ]
    for change, match in cases:
        args = dict(peer_endpoint=rx.endpoint, transfer_id=1, kv=good, first_token=0)
        args.update(change)
        with pytest.raises(ValueError, match=match):
            tx.send(**args)
    assert tx.stats().transfers_ok + tx.stats().failures == 0


def test_layout_mismatch_fails_both_sides() -> None:
    rx_lay, tx_lay = layout("float32"), layout("bfloat16")
    rx = LoopbackReceiver(make_pool(rx_lay), rx_lay)
    tx = LoopbackSender(tx_lay, timeout_s=5.0)
    try:
        with pytest.raises(LayoutMismatchError, match="dtype sender='bfloat16' receiver='float32'"):
            tx.send(rx.endpoint, 1, random_kv(tx_lay, 3, seed=0), 0).result(timeout=5)
        assert rx.stats().handshake_failures == 1 and "dtype" in rx.stats().last_error
        assert tx.stats().handshake_failures == 1
    finally:
        tx.close()
        rx.close()


def test_unreachable_peer_fails_with_a_record() -> None:
    lay = layout()
    tx = LoopbackSender(lay, timeout_s=5.0)
    try:
        with pytest.raises(ChannelClosedError, match="no loopback KV receiver") as err:
            tx.send("loopback:999999", 1, random_kv(lay, 3, seed=0), 0).result(timeout=5)
        assert err.value.record is not None
        assert err.value.record.outcome is TransferOutcome.FAILED
        assert tx.stats().transfers_failed == 1
    finally:
        tx.close()


def test_receiver_restarted_on_the_same_endpoint_is_reached_by_a_retry() -> None:
    """A reused channel whose receiver closed fails before sending: reconnect, retry once."""
    lay = layout()
    pool = make_pool(lay)
    rx = LoopbackReceiver(pool, lay, port=424242)
    tx = LoopbackSender(lay, timeout_s=5.0)
    try:
        rx.expect(1, [0], deadline_in(5))
        assert tx.send(rx.endpoint, 1, random_kv(lay, 2, seed=1), 0).result(timeout=5).bytes
        rx.close()
        rx = LoopbackReceiver(pool, lay, port=424242)
        fut = rx.expect(2, [1, 2], deadline_in(5))
        kv = random_kv(lay, 30, seed=2)
        assert tx.send(rx.endpoint, 2, kv, 0).result(timeout=5).outcome is TransferOutcome.OK
        assert torch.equal(pool.gather([1, 2], 30), kv) and fut.done()
        assert tx.stats().channels_opened == 2 and tx.stats().failures == 0
        with pytest.raises(ValueError, match="loopback:424242 is taken"):
            LoopbackReceiver(pool, lay, port=424242)
    finally:
        tx.close()
        rx.close()


def test_closed_sender_refuses_new_sends(pair: Pair) -> None:
    rx, tx, _ = pair
    tx.close()
    with pytest.raises(ChannelClosedError, match="sender is closed"):
        tx.send(rx.endpoint, 1, random_kv(tx.layout, 1, seed=0), 0)
