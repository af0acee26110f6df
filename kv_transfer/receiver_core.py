"""Reservations and the handling of arriving transfers, shared by every receiver backend.

A backend's channel thread calls :meth:`ReceiverCore.begin` with each TRANSFER header, receives
the payload (always, so the channel stays in step), then calls :meth:`ReceiverCore.finish` to
verify, scatter and get the ack to send back, or :meth:`ReceiverCore.abandon` if the channel broke
before the payload arrived. The engine calls :meth:`expect` and :meth:`cancel`; one reaper thread
expires reservations at their deadlines.

Locks: ``_lock`` guards the table and the deadline heap; each reservation's own lock guards its
state and is held across the scatter. Order: table lock before a reservation lock, never the
reverse; futures are resolved with no lock held (their callbacks may call :meth:`cancel`).
NOTE: a reservation leaves TRANSFERRING only under its lock, and only TRANSFERRING scatters, so
once cancel() returns or the future fails, its blocks are never written again.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kv_transfer.base import (
    ChannelClosedError,
    KVLayout,
    KVTransferError,
    StatsCounter,
    TransferExpiredError,
    TransferOutcome,
    TransferRecord,
    TransferResult,
    TransferState,
    TransferTimeoutError,
)
from kv_transfer.wire import Ack, AckStatus, Header, check_transfer_id, checksum, payload_from_wire

if TYPE_CHECKING:
    from pdserve.kv_cache.pool import KVPool


def _settle(future: Future[TransferResult], outcome: TransferResult | BaseException) -> None:
    """Resolve ``future`` unless its owner already cancelled it directly."""
    try:
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
    except InvalidStateError:
        pass


@dataclass(eq=False)
class Reservation:
    """Blocks reserved for one transfer id until ``deadline`` (``time.monotonic()`` seconds)."""

    transfer_id: int
    block_ids: tuple[int, ...]
    deadline: float
    future: Future[TransferResult]
    state: TransferState = TransferState.RESERVED
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class Incoming:
    """A TRANSFER whose header arrived: what to do with its payload."""

    header: Header
    reservation: Reservation | None  # claimed (TRANSFERRING) reservation, None = drop
    status: AckStatus  # OK so far, or why the payload will be dropped
    error: str  # text of a non-OK status
    started: float  # time.monotonic() at header receipt


class ReceiverCore:
    """The receiver's reservation table over one KV pool.

    ``pool``: the decode worker's :class:`~pdserve.kv_cache.pool.KVPool` (payloads are scattered
    into it); ``layout``: its layout (checked against the pool); ``stats``: counters to update.
    Raises ValueError when ``layout`` does not describe ``pool``.
    """

    def __init__(self, pool: KVPool, layout: KVLayout, stats: StatsCounter) -> None:
        pool_layout = KVLayout.from_pool(pool, layout.model_id)
        bad = pool_layout.differences(layout)
        if bad:
            raise ValueError(f"KV layout {layout} does not describe the pool (fields {bad})")
        self.pool = pool
        self.layout = layout
        self._stats = stats
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._table: dict[int, Reservation] = {}
        self._heap: list[tuple[float, int, Reservation]] = []  # (deadline, seq, reservation)
        self._seq = itertools.count()
        self._closed = False
        self._reaper: threading.Thread | None = None

    # ---------------------------------------------------------------------------- engine side
    def expect(
        self, transfer_id: int, block_ids: Sequence[int], deadline: float
    ) -> Future[TransferResult]:
        """See :meth:`kv_transfer.base.KVReceiver.expect` (``deadline``: ``time.time()`` s)."""
        tid = check_transfer_id(transfer_id)
        blocks = tuple(int(b) for b in block_ids)
        if not blocks:
            raise ValueError("block_ids must name at least one block")
        bad = [b for b in blocks if not 0 <= b < self.pool.num_blocks]
        if bad:
            raise ValueError(f"block_ids {bad} are outside the pool [0, {self.pool.num_blocks})")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"block_ids repeat: {list(blocks)}")
        remaining = float(deadline) - time.time()
        if remaining <= 0:
            raise ValueError(f"deadline {deadline:.3f} is {-remaining:.3f} s in the past")
        res = Reservation(tid, blocks, time.monotonic() + remaining, Future())
        with self._lock:
            if self._closed:
                raise ChannelClosedError("KV receiver is closed")
            if tid in self._table:
                raise ValueError(f"transfer_id {tid} is already reserved")
            self._table[tid] = res
            heapq.heappush(self._heap, (res.deadline, next(self._seq), res))
            if self._reaper is None:
                self._reaper = threading.Thread(
                    target=self._reap, name="kv-reservation-reaper", daemon=True
                )
                self._reaper.start()
            self._wake.notify()
        return res.future

    def cancel(self, transfer_id: int) -> bool:
        """Drop a reservation; True if it was still waiting (its future is then cancelled)."""
        with self._lock:
            res = self._table.pop(transfer_id, None)
        if res is None:
            return False
        with res.lock:  # waits for a scatter in progress
            if res.state not in (TransferState.RESERVED, TransferState.TRANSFERRING):
                return False
            res.state = TransferState.CANCELLED
        self._stats.bump("reservations_cancelled")
        res.future.cancel()
        return True

    def pending(self) -> int:
        """Reservations still waiting for their KV."""
        with self._lock:
            return len(self._table)

    # --------------------------------------------------------------------------- channel side
    def begin(self, header: Header) -> Incoming:
        """Claim the reservation named by a TRANSFER header and check its sizes."""
        now = time.monotonic()
        res = None
        with self._lock:
            cand = self._table.get(header.transfer_id)
        if cand is not None:
            with cand.lock:
                if cand.state is TransferState.RESERVED:
                    cand.state = TransferState.TRANSFERRING
                    res = cand
        incoming = Incoming(header, res, AckStatus.OK, "", now)
        bpt = self.layout.bytes_per_token
        capacity = len(res.block_ids) * self.layout.block_size if res else 0
        if header.num_tokens <= 0 or header.payload_bytes != header.num_tokens * bpt:
            incoming.status = AckStatus.SIZE_MISMATCH
            incoming.error = (
                f"payload of {header.payload_bytes} bytes for {header.num_tokens} tokens; the "
                f"layout needs {bpt} bytes per token and at least one token"
            )
        elif res is None:
            incoming.status = AckStatus.NOT_RESERVED
            incoming.error = (
                f"transfer_id {header.transfer_id} is not reserved (unknown, cancelled, expired "
                "or already transferring)"
            )
        elif header.num_tokens > capacity:
            incoming.status = AckStatus.TOO_MANY_TOKENS
            incoming.error = (
                f"{header.num_tokens} tokens exceed the {len(res.block_ids)} reserved blocks "
                f"of {self.layout.block_size} tokens"
            )
        return incoming

    def finish(self, incoming: Incoming, payload: torch.Tensor | None) -> Ack:
        """Verify and scatter a received payload (``uint8``, at least ``payload_bytes`` long).

        Resolves or fails the reservation's future and returns the ack to send. ``payload`` may
        be None when the status is already a drop (nothing to look at).
        """
        h, res = incoming.header, incoming.reservation
        status, error = incoming.status, incoming.error
        if status is AckStatus.OK and payload is not None and h.has_checksum:
            got = checksum(payload[: h.payload_bytes])
            if got != h.checksum:
                status = AckStatus.CHECKSUM_MISMATCH
                error = f"payload CRC-32 {got:#010x} != header {h.checksum:#010x}"
        result: TransferResult | None = None
        failure: KVTransferError | None = None
        if res is not None:
            with res.lock:
                if res.state is not TransferState.TRANSFERRING:  # cancelled/expired in flight
                    if status is AckStatus.OK:
                        status = AckStatus.NOT_RESERVED
                        error = f"transfer_id {h.transfer_id} was {res.state.value} in flight"
                    res = None
                elif status is AckStatus.OK:
                    assert payload is not None
                    try:
                        kv = payload_from_wire(payload, self.layout, h.num_tokens)
                        self.pool.scatter(res.block_ids, kv)
                        res.state = TransferState.DONE
                    except (ValueError, RuntimeError) as e:
                        status, error = AckStatus.SCATTER_FAILED, f"scatter failed: {e}"
                        res.state = TransferState.FAILED
                else:
                    res.state = TransferState.FAILED
        record = self._record(incoming, status, error)
        if res is not None:
            with self._lock:
                if self._table.get(h.transfer_id) is res:
                    del self._table[h.transfer_id]
            if status is AckStatus.OK:
                result = TransferResult(
                    transfer_id=h.transfer_id,
                    num_tokens=h.num_tokens,
                    block_ids=res.block_ids,
                    first_token=h.first_token,
                    first_logprob=h.first_logprob,
                    record=record,
                )
                _settle(res.future, result)
            else:
                failure = KVTransferError(f"KV transfer {h.transfer_id} failed: {error}", record)
                _settle(res.future, failure)
        return Ack(h.transfer_id, status)

    def abandon(self, incoming: Incoming, error: BaseException) -> None:
        """The channel broke before the payload arrived: the reservation waits again."""
        res = incoming.reservation
        if res is not None:
            with res.lock:
                if res.state is TransferState.TRANSFERRING:
                    res.state = TransferState.RESERVED
        timed_out = isinstance(error, TransferTimeoutError)
        self._stats.add_record(
            TransferRecord(
                transfer_id=incoming.header.transfer_id,
                bytes=0,
                ms=(time.monotonic() - incoming.started) * 1e3,
                outcome=TransferOutcome.TIMEOUT if timed_out else TransferOutcome.FAILED,
                error=str(error),
            )
        )

    def close(self) -> None:
        """Fail every pending reservation with ChannelClosedError and stop the reaper."""
        with self._lock:
            self._closed = True
            pending = list(self._table.values())
            self._table.clear()
            self._heap.clear()
            self._wake.notify()
        for res in pending:
            with res.lock:
                if res.state not in (TransferState.RESERVED, TransferState.TRANSFERRING):
                    continue
                res.state = TransferState.FAILED
            _settle(
                res.future,
                ChannelClosedError(f"KV receiver closed before transfer {res.transfer_id}"),
            )

    # -------------------------------------------------------------------------------- helpers
    def _record(self, incoming: Incoming, status: AckStatus, error: str) -> TransferRecord:
        h = incoming.header
        if status is AckStatus.OK:
            outcome = TransferOutcome.OK
        elif status is AckStatus.NOT_RESERVED:
            outcome = TransferOutcome.DROPPED
        else:
            outcome = TransferOutcome.FAILED
        record = TransferRecord(
            transfer_id=h.transfer_id,
            bytes=h.payload_bytes if outcome is TransferOutcome.OK else 0,
            ms=(time.monotonic() - incoming.started) * 1e3,
            outcome=outcome,
            error=error,
        )
        self._stats.add_record(record)
        return record

    def _reap(self) -> None:
        """Reaper thread: fail reservations whose deadline passed."""
        while True:
            expired: list[Reservation] = []
            with self._lock:
                while not self._closed:
                    now = time.monotonic()
                    while self._heap and self._heap[0][0] <= now:
                        _, _, res = heapq.heappop(self._heap)
                        if self._table.get(res.transfer_id) is res:
                            del self._table[res.transfer_id]
                            expired.append(res)
                    if expired:
                        break
                    wait = self._heap[0][0] - now if self._heap else None
                    self._wake.wait(wait)
                if self._closed and not expired:
                    return
            for res in expired:
                with res.lock:  # waits for a scatter in progress
                    if res.state not in (TransferState.RESERVED, TransferState.TRANSFERRING):
                        continue
                    res.state = TransferState.EXPIRED
                self._stats.bump("reservations_expired")
                _settle(
                    res.future,
                    TransferExpiredError(
                        f"KV for transfer {res.transfer_id} did not arrive before its deadline; "
                        f"its {len(res.block_ids)} reserved blocks may be freed"
                    ),
                )
