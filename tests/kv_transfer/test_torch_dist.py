"""torch_dist backend over gloo: the acceptance list of issue 3, across real OS processes.

Each test keeps to a few spawned processes and small payloads (tiny layout: 512 bytes/token in
float32) so the module runs in well under a minute on two shared cores.
"""

from __future__ import annotations

import logging
import random
import socket
import time

import pytest
import torch
from kv_transfer_kit import (
    deadline_in,
    layout,
    make_pool,
    random_kv,
    receiver_child,
    recv,
    scattered_blocks,
    sender_child,
    spawn,
    wait_gone,
)

from kv_transfer.base import (
    ChannelClosedError,
    KVTransferError,
    LayoutMismatchError,
    TransferExpiredError,
    TransferOutcome,
    TransferTimeoutError,
)
from kv_transfer.torch_dist import TorchDistReceiver, TorchDistSender
from kv_transfer.wire import Header
from pdserve.kv_cache.manager import KVCacheManager
from pdserve.kv_cache.pool import KVPool

pytestmark = pytest.mark.timeout(90)


def test_two_processes_bit_exact_1_17_1000_tokens() -> None:
    """Random KV for random non-contiguous blocks arrives bit-exact; header fields round-trip."""
    lay = layout("float32")
    proc, conn = spawn(receiver_child, lay.to_dict(), 0, 128, False)
    tx = TorchDistSender(lay, timeout_s=20.0, checksum=True)
    try:
        endpoint = recv(conn)
        for i, n in enumerate((1, 17, 1000)):
            tid = 2**62 + 1000 + i  # large ids survive the int64 header
            blocks = scattered_blocks(n, 128, seed=n)
            conn.send(("expect", tid, blocks, deadline_in(30)))
            assert recv(conn) == "ok"
            kv = random_kv(lay, n, seed=n)
            logprob = -1.0 / 3.0 - i  # not representable in float32: checks the float64 bits
            rec = tx.send(endpoint, tid, kv, 49151 - i, logprob).result(timeout=30)
            assert rec.outcome is TransferOutcome.OK
            assert rec.transfer_id == tid and rec.bytes == n * lay.bytes_per_token
            conn.send(("wait", tid, blocks, 10.0))
            first_token, first_logprob, num_tokens, got = recv(conn)
            assert (first_token, first_logprob, num_tokens) == (49151 - i, logprob, n)
            assert torch.equal(got, kv)
        s = tx.stats()
        assert (s.transfers_ok, s.failures, s.channels_opened) == (3, 0, 1)
        assert s.bytes == 1018 * lay.bytes_per_token
        conn.send(("stats",))
        rs = recv(conn)
        assert rs.transfers_ok == 3 and rs.channels_opened == 1
    finally:
        tx.close()
        conn.close()
        wait_gone(proc)


def test_three_sender_processes_thirty_interleaved_transfers() -> None:
    """Three prefill processes each queue 10 transfers at once to one receiver; all bit-exact."""
    lay = layout("bfloat16")  # bf16 crosses gloo as raw bytes
    pool = make_pool(lay, num_blocks=256)
    rx = TorchDistReceiver(pool, lay, timeout_s=20.0)
    rng = random.Random(3)
    free = list(range(pool.num_blocks))
    rng.shuffle(free)
    jobs: list[list[tuple[int, int, int]]] = [[], [], []]
    expected: dict[int, tuple[list[int], int]] = {}
    futures = {}
    for k in range(30):
        tid, n = 500 + k, rng.randint(1, 100)
        blocks = [free.pop() for _ in range(-(-n // lay.block_size))]
        expected[tid] = (blocks, n)
        futures[tid] = rx.expect(tid, blocks, deadline_in(60))
        jobs[k % 3].append((tid, n, tid))
    children = [spawn(sender_child, lay.to_dict(), rx.endpoint, j) for j in jobs]
    try:
        for _, conn in children:
            conn.send("go")
        for _, conn in children:
            for tid, outcome, nbytes in recv(conn, 60):
                assert outcome == "ok", tid
                assert nbytes == expected[tid][1] * lay.bytes_per_token
        for tid, (blocks, n) in expected.items():
            res = futures[tid].result(timeout=10)
            assert res.num_tokens == n and res.first_token == tid % 1000
            assert res.first_logprob == -0.5 * tid
            assert torch.equal(pool.gather(blocks, n), random_kv(lay, n, seed=tid)), tid
        s = rx.stats()
        assert (s.transfers_ok, s.failures, s.channels_opened) == (30, 0, 3)
    finally:
        for proc, conn in children:
            conn.close()
            wait_gone(proc)
        rx.close()


def test_unknown_and_cancelled_ids_are_drained_and_dropped() -> None:
    """A transfer for an unknown or cancelled id is dropped; the next one on the channel is exact."""
    lay = layout()
    pool = make_pool(lay)
    rx = TorchDistReceiver(pool, lay, timeout_s=10.0)
    tx = TorchDistSender(lay, timeout_s=10.0)
    try:
        cancelled = rx.expect(1, [3, 7], deadline_in(30))
        assert rx.cancel(1) and cancelled.cancelled() and not rx.cancel(1)
        for tid in (1, 99):  # cancelled, never reserved
            rec = tx.send(rx.endpoint, tid, random_kv(lay, 20, seed=tid), 5).result(timeout=10)
            assert rec.outcome is TransferOutcome.DROPPED and rec.bytes == 0
            assert f"transfer {tid}" in rec.error
        assert torch.count_nonzero(pool.kv) == 0  # nothing was written anywhere
        fut = rx.expect(2, [9, 4], deadline_in(30))
        kv = random_kv(lay, 30, seed=2)
        assert tx.send(rx.endpoint, 2, kv, 6, -2.5).result(timeout=10).outcome.value == "ok"
        res = fut.result(timeout=5)
        assert (res.first_token, res.first_logprob) == (6, -2.5)
        assert torch.equal(pool.gather([9, 4], 30), kv)
        s = rx.stats()
        assert (s.transfers_dropped, s.transfers_ok, s.reservations_cancelled) == (2, 1, 1)
        assert tx.stats().channels_opened == 1  # the channel stayed in step throughout
    finally:
        tx.close()
        rx.close()


def test_receiver_killed_mid_transfer_then_new_receiver_on_same_address() -> None:
    """The sender's future fails within its timeout; a new receiver on the port pairs again."""
    lay = layout()
    proc, conn = spawn(receiver_child, lay.to_dict(), 0, 128, True)
    tx = TorchDistSender(lay, timeout_s=8.0)
    try:
        endpoint = recv(conn)
        port = int(endpoint.rsplit(":", 1)[1])
        conn.send(("expect", 11, list(range(63, 0, -1)), deadline_in(30)))
        assert recv(conn) == "ok"
        t0 = time.monotonic()
        fut = tx.send(endpoint, 11, random_kv(lay, 1000, seed=1), 1)
        with pytest.raises(KVTransferError) as err:
            fut.result(timeout=30)
        assert time.monotonic() - t0 < 8.0
        assert isinstance(err.value, ChannelClosedError | TransferTimeoutError)
        assert err.value.record is not None and err.value.record.outcome.value == "failed"
        wait_gone(proc)
        assert proc.exitcode == 17  # it died on the header, payload in flight
        conn.close()

        proc, conn = spawn(receiver_child, lay.to_dict(), port, 128, False)
        assert recv(conn) == endpoint
        blocks = scattered_blocks(100, 128, seed=5)
        conn.send(("expect", 12, blocks, deadline_in(30)))
        assert recv(conn) == "ok"
        kv = random_kv(lay, 100, seed=12)
        assert tx.send(endpoint, 12, kv, 2).result(timeout=30).outcome is TransferOutcome.OK
        conn.send(("wait", 12, blocks, 10.0))
        assert torch.equal(recv(conn)[3], kv)
        s = tx.stats()
        assert (s.transfers_ok, s.transfers_failed, s.channels_opened) == (1, 1, 2)
    finally:
        tx.close()
        conn.close()
        wait_gone(proc)


def test_layout_mismatch_fails_both_sides_naming_the_field(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A sender with head_dim 32 cannot pair with a head_dim 16 receiver: both sides say so."""
    rx_layout, tx_layout = layout(head_dim=16), layout(head_dim=32)
    rx = TorchDistReceiver(make_pool(rx_layout), rx_layout, timeout_s=10.0)
    tx = TorchDistSender(tx_layout, timeout_s=10.0)
    try:
        fut = rx.expect(1, [0], deadline_in(30))
        caplog.set_level(logging.ERROR, logger="kv_transfer.torch_dist")
        with pytest.raises(LayoutMismatchError, match="head_dim sender=32 receiver=16"):
            tx.send(rx.endpoint, 1, random_kv(tx_layout, 4, seed=0), 0).result(timeout=20)
        rs = rx.stats()
        assert rs.handshake_failures == 1 and "head_dim" in rs.last_error
        assert "head_dim sender=32 receiver=16" in caplog.text
        assert tx.stats().handshake_failures == 1 and rx.num_channels() == 0
        assert not fut.done()  # the reservation still waits for a compatible sender
    finally:
        tx.close()
        rx.close()


def test_expired_reservation_frees_its_blocks() -> None:
    """A reservation whose KV never comes fails at its deadline; the engine frees the blocks."""
    lay = layout()
    pool = make_pool(lay, num_blocks=16)
    mgr = KVCacheManager(num_blocks=16, block_size=lay.block_size)
    rx = TorchDistReceiver(pool, lay, timeout_s=10.0)
    tx = TorchDistSender(lay, timeout_s=10.0)
    try:
        table = mgr.allocate_slots("req-1", 40)
        assert table is not None and mgr.num_free_blocks == 13
        fut = rx.expect(21, table, deadline_in(0.3))
        fut.add_done_callback(lambda f: mgr.free("req-1") if f.exception() else None)
        with pytest.raises(TransferExpiredError, match="did not arrive before its deadline"):
            fut.result(timeout=5)
        assert mgr.num_free_blocks == 16 and not mgr.has("req-1")
        mgr.check_integrity()
        assert rx.stats().reservations_expired == 1
        # Late KV for the expired id is drained and dropped, never written into the freed blocks.
        rec = tx.send(rx.endpoint, 21, random_kv(lay, 40, seed=0), 1).result(timeout=10)
        assert rec.outcome is TransferOutcome.DROPPED
        assert torch.count_nonzero(pool.kv) == 0
    finally:
        tx.close()
        rx.close()


def test_stalled_receiver_times_out_and_reservation_survives_for_a_retry() -> None:
    """A receiver stuck after the header: the send times out, the channel is rebuilt, and the
    reservation (never written) is filled by the retry."""
    lay = layout()
    pool = make_pool(lay)
    stall = {"first": True}

    def stall_once(_header: Header) -> None:
        if stall["first"]:
            stall["first"] = False
            time.sleep(2.5)

    rx = TorchDistReceiver(pool, lay, timeout_s=10.0, on_header=stall_once)
    tx = TorchDistSender(lay, timeout_s=1.0)
    try:
        fut = rx.expect(5, [8, 1, 6], deadline_in(30))
        kv = random_kv(lay, 40, seed=5)
        t0 = time.monotonic()
        with pytest.raises(TransferTimeoutError):
            tx.send(rx.endpoint, 5, kv, 3).result(timeout=10)
        assert time.monotonic() - t0 < 2.0
        deadline = time.monotonic() + 10
        while rx.num_channels() and time.monotonic() < deadline:  # the stalled side notices
            time.sleep(0.05)
        assert not fut.done()
        assert tx.send(rx.endpoint, 5, kv, 3).result(timeout=10).outcome is TransferOutcome.OK
        assert torch.equal(pool.gather([8, 1, 6], 40), kv)
        assert fut.result(timeout=5).first_token == 3
        s = tx.stats()
        assert (s.transfers_timeout, s.transfers_ok, s.channels_opened) == (1, 1, 2)
    finally:
        tx.close()
        rx.close()


def test_channel_found_dead_when_idle_is_rebuilt_without_failing_the_transfer() -> None:
    """The receiver restarts on the same port while the channel sits idle: the next send's
    ping finds the channel dead, the sender reconnects, and the transfer succeeds."""
    lay = layout()
    pool = make_pool(lay)
    rx = TorchDistReceiver(pool, lay, timeout_s=10.0)
    port = int(rx.endpoint.rsplit(":", 1)[1])
    tx = TorchDistSender(lay, timeout_s=10.0, ping_after_idle_s=0.1)
    try:
        fut = rx.expect(1, [0], deadline_in(30))
        assert tx.send(rx.endpoint, 1, random_kv(lay, 3, seed=1), 0).result(timeout=10).bytes
        fut.result(timeout=5)
        rx.close()
        rx = TorchDistReceiver(pool, lay, port=port, timeout_s=10.0)
        time.sleep(0.2)  # idle past ping_after_idle_s: the next send pings first
        fut = rx.expect(2, [5, 2], deadline_in(30))
        kv = random_kv(lay, 20, seed=2)
        assert tx.send(rx.endpoint, 2, kv, 0).result(timeout=10).outcome is TransferOutcome.OK
        assert torch.equal(pool.gather([5, 2], 20), kv) and fut.result(timeout=5).num_tokens == 20
        s = tx.stats()
        assert (s.transfers_ok, s.failures, s.channels_opened) == (2, 0, 2)
    finally:
        tx.close()
        rx.close()


def test_idle_channel_is_closed_by_the_receiver_and_rebuilt_by_the_sender() -> None:
    """With a 1 s idle timeout the receiver drops the channel; the next send reconnects."""
    lay = layout()
    pool = make_pool(lay)
    rx = TorchDistReceiver(pool, lay, timeout_s=10.0, idle_timeout_s=1.0)
    tx = TorchDistSender(lay, timeout_s=10.0)
    try:
        for tid in (1, 2):
            fut = rx.expect(tid, [tid], deadline_in(30))
            kv = random_kv(lay, 16, seed=tid)
            assert tx.send(rx.endpoint, tid, kv, 0).result(timeout=10).outcome.value == "ok"
            assert torch.equal(pool.gather([tid], 16), kv) and fut.done()
            time.sleep(1.5)
        assert rx.num_channels() == 0
        assert rx.stats().channels_closed == 2 and tx.stats().channels_opened == 2
    finally:
        tx.close()
        rx.close()


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"NCCL path needs 2 CUDA devices; this machine has {torch.cuda.device_count()}",
)
def test_nccl_two_devices_bit_exact() -> None:
    """The same channel code over NCCL between two GPUs (only device selection differs)."""
    lay = layout("bfloat16")
    gpu_pool = KVPool(2, 64, 16, 2, 16, torch.bfloat16, device="cuda:0")
    rx = TorchDistReceiver(gpu_pool, lay, timeout_s=30.0)
    tx = TorchDistSender(lay, device="cuda:1", timeout_s=30.0)
    try:
        fut = rx.expect(1, [9, 3], deadline_in(60))
        kv = random_kv(lay, 30, seed=1).to("cuda:1")
        assert tx.send(rx.endpoint, 1, kv, 4).result(timeout=60).outcome is TransferOutcome.OK
        assert fut.result(timeout=10).first_token == 4
        assert torch.equal(gpu_pool.gather([9, 3], 30).cpu(), kv.cpu())
    finally:
        tx.close()
        rx.close()


def test_unreachable_receiver_fails_the_queue_within_the_timeout() -> None:
    """Nothing listens: the first transfer fails after its 1 s connect timeout, the two queued
    behind it fail with it, and a malformed endpoint is refused at once."""
    lay = layout()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free again once closed: nothing listens there
    tx = TorchDistSender(lay, timeout_s=1.0)
    try:
        with pytest.raises(ValueError, match="'host:port' with port 1..65535"):
            tx.send("127.0.0.1", 1, random_kv(lay, 2, seed=0), 0)
        t0 = time.monotonic()
        futs = [tx.send(f"127.0.0.1:{port}", i, random_kv(lay, 2, seed=i), 0) for i in range(3)]
        errors = [f.exception(timeout=20) for f in futs]
        assert time.monotonic() - t0 < 5.0
        assert isinstance(errors[0], ChannelClosedError | TransferTimeoutError)
        for e in errors[1:]:
            assert isinstance(e, ChannelClosedError) and "failed earlier" in str(e)
        assert tx.stats().failures == 3
    finally:
        tx.close()
