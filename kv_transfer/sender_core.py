"""The sender side shared by every backend: one ordered queue and thread per peer.

``send`` validates its arguments, then queues the transfer on the peer's queue. The peer's
thread connects lazily (handshake included), runs the transfers one at a time in order, and
turns each ack into a :class:`~kv_transfer.base.TransferRecord`. A backend only supplies
:meth:`QueuedSender._connect`, returning a :class:`PeerChannel`.

Failure policy: a timeout, a broken channel or a protocol error tears the channel down; the
transfer in flight and every transfer queued behind it fail with the error (their reservations
on that peer are gone or stale), and the next ``send`` to the peer connects afresh.

Dead idle channels: a channel unused for ``ping_after_idle_s`` is pinged (one header and ack,
no side effect) before its next transfer, and rebuilt if the ping fails, so a peer that died or
restarted while the channel sat idle costs a reconnect, not a failed transfer. Likewise a reused
channel that fails before the header could leave (:class:`StaleChannelError`) is rebuilt and the
transfer retried once, since the peer cannot have seen it.

CUDA payloads: ``send`` records an event on the caller's stream right after the payload was
gathered, and the peer's thread runs the transfer on its own CUDA stream that waits only for that
event. NCCL orders its send after the calling thread's current stream, so on the default stream
it would also wait for whatever the caller queued next; on the side stream the KV send of one
request overlaps the next prefill's forward.
"""

from __future__ import annotations

import logging
import math
import operator
import queue
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from kv_transfer.base import (
    ChannelClosedError,
    KVLayout,
    KVSender,
    KVTransferError,
    LayoutMismatchError,
    StatsCounter,
    TransferOutcome,
    TransferRecord,
    TransferStats,
    TransferTimeoutError,
)
from kv_transfer.wire import (
    FLAG_CHECKSUM,
    Ack,
    AckStatus,
    Header,
    MessageKind,
    check_transfer_id,
    checksum,
    payload_to_wire,
)

if TYPE_CHECKING:
    from pdserve.engine.faults import FaultInjector

log = logging.getLogger(__name__)


class StaleChannelError(ChannelClosedError):
    """A reused channel turned out dead before this transfer's header left: safe to retry."""


class PeerChannel(ABC):
    """One connected channel to one receiver, driven by one thread at a time.

    ``idle_limit_s``: rebuild the channel before using it after this long without traffic
    (the receiver closes idle channels; None = never).
    """

    idle_limit_s: float | None = None

    @abstractmethod
    def transfer(self, header: Header, payload: torch.Tensor, deadline: float) -> Ack:
        """Send ``header`` then ``payload`` (flat ``uint8``) and wait for the ack.

        ``deadline`` is a ``time.monotonic()`` value bounding the whole exchange. Raises
        TransferTimeoutError, ChannelClosedError (StaleChannelError when nothing left) or
        ProtocolError; after any of these the channel is unusable.
        """

    @abstractmethod
    def ping(self, deadline: float) -> None:
        """Round-trip a no-op message. Raises KVTransferError when the channel is dead."""

    @abstractmethod
    def close(self, graceful: bool) -> None:
        """Release the channel; ``graceful`` first tells the receiver (best effort)."""


@dataclass
class _Job:
    peer: str
    header: Header  # checksum not yet filled in
    payload: torch.Tensor  # flat uint8
    future: Future[TransferRecord]
    ready: torch.cuda.Event | None = None  # CUDA payloads: recorded after the gather


class QueuedSender(KVSender):
    """A :class:`KVSender` over per-peer ordered queues.

    ``layout``: this worker's KV layout (checked on every send and in the handshake).
    ``device``: where payloads live ('cpu' or a CUDA device). ``timeout_s``: bound on connecting
    and, separately, on one transfer from header to ack. ``checksum``: add a CRC-32 of the
    payload for the receiver to verify. ``ping_after_idle_s``: ping a channel idle this long
    before reusing it (see the module docstring). ``faults``: stall or corrupt transfers on
    purpose (tests, ``/admin/faults``); with an injector the checksum is always on, so a
    corrupted payload is refused by the receiver, never scattered.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        device: str | torch.device = "cpu",
        timeout_s: float = 30.0,
        checksum: bool = False,
        ping_after_idle_s: float = 1.0,
        faults: FaultInjector | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not ping_after_idle_s >= 0:
            raise ValueError(f"ping_after_idle_s must be >= 0, got {ping_after_idle_s}")
        self.ping_after_idle_s = float(ping_after_idle_s)
        self.layout = layout
        self.device = torch.device(device)
        self.timeout_s = float(timeout_s)
        self.faults = faults
        self.checksum = checksum or faults is not None
        self._stats = StatsCounter()
        self._lock = threading.Lock()
        self._peers: dict[str, _PeerQueue] = {}
        self._closed = False

    # ------------------------------------------------------------------------ backend hook
    @abstractmethod
    def _connect(self, peer: str) -> PeerChannel:
        """Open a channel to ``peer`` (handshake included) within ``self.timeout_s``.

        Raises LayoutMismatchError when the receiver refuses the layout, ChannelClosedError or
        TransferTimeoutError when it cannot be reached.
        """

    def _check_peer(self, peer: str) -> None:  # noqa: B027 - optional hook, default accepts all
        """Raise ValueError when ``peer`` is not an endpoint this backend can reach."""

    # -------------------------------------------------------------------------------- API
    def send(
        self,
        peer_endpoint: str,
        transfer_id: int,
        kv: torch.Tensor,
        first_token: int,
        first_logprob: float = 0.0,
    ) -> Future[TransferRecord]:
        """See :meth:`kv_transfer.base.KVSender.send`."""
        tid = check_transfer_id(transfer_id)
        if not isinstance(peer_endpoint, str) or not peer_endpoint:
            raise ValueError(
                f"peer_endpoint must be a non-empty 'host:port', got {peer_endpoint!r}"
            )
        self._check_peer(peer_endpoint)
        self._check_kv(kv)
        try:
            token = operator.index(first_token)
        except TypeError:
            raise ValueError(f"first_token must be an int, got {first_token!r}") from None
        if not 0 <= token < 2**63:
            raise ValueError(f"first_token must be in [0, 2**63), got {token}")
        logprob = float(first_logprob)
        if math.isnan(logprob):
            raise ValueError("first_logprob is NaN")
        num_tokens = int(kv.shape[2])
        payload = payload_to_wire(kv)
        header = Header(
            kind=MessageKind.TRANSFER,
            transfer_id=tid,
            num_tokens=num_tokens,
            payload_bytes=payload.numel(),
            flags=FLAG_CHECKSUM if self.checksum else 0,
            first_token=token,
            first_logprob=logprob,
        )
        ready = None
        if payload.is_cuda:  # the gather (and payload copy) is queued on the caller's stream
            ready = torch.cuda.Event()
            ready.record()
        fut: Future[TransferRecord] = Future()
        with self._lock:
            if self._closed:
                raise ChannelClosedError("KV sender is closed")
            peer = self._peers.get(peer_endpoint)
            if peer is None:
                peer = self._peers[peer_endpoint] = _PeerQueue(self, peer_endpoint)
            peer.put(_Job(peer_endpoint, header, payload, fut, ready))
        return fut

    def stats(self) -> TransferStats:
        """Counters since start."""
        return self._stats.snapshot()

    def close(self) -> None:
        """Close every channel (telling receivers). Transfers in flight finish; queued ones fail
        with ChannelClosedError."""
        with self._lock:
            self._closed = True
            peers = list(self._peers.values())
            self._peers.clear()
        for p in peers:
            p.put(None)
        for p in peers:
            p.thread.join(timeout=self.timeout_s + 5.0)

    # ------------------------------------------------------------------------------ helpers
    def _check_kv(self, kv: torch.Tensor) -> None:
        lay = self.layout
        if not isinstance(kv, torch.Tensor):
            raise ValueError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
        want = lay.payload_shape(kv.shape[2] if kv.dim() == 5 else -1)
        if kv.dim() != 5 or tuple(kv.shape) != want or kv.shape[2] < 1:
            raise ValueError(
                f"kv must be [num_layers={lay.num_layers}, 2, num_tokens>=1, "
                f"num_kv_heads={lay.num_kv_heads}, head_dim={lay.head_dim}], got {list(kv.shape)}"
            )
        if kv.dtype != lay.torch_dtype:
            raise ValueError(f"kv dtype {kv.dtype} != layout dtype {lay.dtype}")
        if kv.device.type != self.device.type:
            raise ValueError(f"kv is on {kv.device}, this sender moves {self.device.type} tensors")


class _PeerQueue:
    """The ordered queue and thread of one peer (see the module docstring)."""

    def __init__(self, sender: QueuedSender, peer: str) -> None:
        self.sender = sender
        self.peer = peer
        self.jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.channel: PeerChannel | None = None
        self.last_used = 0.0  # time.monotonic() of the channel's last traffic
        self.stream: torch.cuda.Stream | None = None  # CUDA: this thread's transfer stream
        self.thread = threading.Thread(target=self._run, name=f"kv-send-{peer}", daemon=True)
        self.thread.start()

    def put(self, job: _Job | None) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        stop = False
        while not stop:
            job = self.jobs.get()
            if job is None:
                break
            if not job.future.set_running_or_notify_cancel():
                continue
            if self.sender._closed:
                self._fail(job, ChannelClosedError("KV sender closed before sending"))
                continue
            try:
                with self._on_stream(job):
                    error = self._run_job(job)
            except Exception as e:  # a bug: fail the transfer instead of killing the queue
                log.exception("KV transfer %d to %s failed", job.header.transfer_id, self.peer)
                self._teardown(graceful=False)
                error = self._fail(job, KVTransferError(f"unexpected error: {e!r}"))
            if error is not None:  # the channel is gone: fail everything queued behind
                stop = self._fail_queued(error)
        self._teardown(graceful=True)
        self._fail_queued(ChannelClosedError(f"KV sender closed; channel to {self.peer} closed"))

    def _on_stream(self, job: _Job) -> AbstractContextManager[object]:
        """CUDA: run the job on this peer's side stream, after the payload's gather (see the
        module docstring). CPU: nothing."""
        if job.ready is None:
            return nullcontext()
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=job.payload.device)
        self.stream.wait_event(job.ready)
        # the caching allocator must not hand the payload's memory to the caller's stream
        # before this stream has finished sending it
        job.payload.record_stream(self.stream)
        return torch.cuda.stream(self.stream)

    def _run_job(self, job: _Job) -> KVTransferError | None:
        """Run one transfer; returns the error that broke the channel, if one did."""
        s = self.sender
        header = job.header
        started = time.monotonic()
        if header.has_checksum:
            header = replace(header, checksum=checksum(job.payload))
        payload = job.payload
        if s.faults is not None:
            stall = s.faults.transfer_stall_s()
            if stall:
                log.warning(
                    "fault injection: stalling KV transfer %d %.1f s", header.transfer_id, stall
                )
                time.sleep(stall)
            payload = s.faults.corrupt(payload)
        for attempt in (0, 1):
            fresh = True
            try:
                fresh = self._ensure_channel()
                assert self.channel is not None
                started = time.monotonic()  # the record's ms run from header send to ack
                ack = self.channel.transfer(header, payload, started + s.timeout_s)
                self.last_used = time.monotonic()
            except StaleChannelError as e:
                self._teardown(graceful=False)
                if fresh or attempt:
                    return self._fail(job, e, started)
                log.info("KV channel to %s was stale (%s); reconnecting", self.peer, e)
                continue
            except KVTransferError as e:
                if isinstance(e, LayoutMismatchError):
                    s._stats.bump("handshake_failures", error=str(e))
                self._teardown(graceful=False)
                return self._fail(job, e, started)
            self._finish(job, ack, started)
            return None
        raise AssertionError("unreachable")

    def _ensure_channel(self) -> bool:
        """Connect if needed (or the channel idled out or died); True when the channel is new."""
        ch = self.channel
        if ch is not None:
            idle = time.monotonic() - self.last_used
            if ch.idle_limit_s is not None and idle > ch.idle_limit_s:
                self._teardown(graceful=True)
                ch = None
            elif idle > self.sender.ping_after_idle_s:
                try:
                    ch.ping(time.monotonic() + self.sender.timeout_s)
                    self.last_used = time.monotonic()
                except KVTransferError as e:
                    log.info("KV channel to %s failed its ping (%s); reconnecting", self.peer, e)
                    self._teardown(graceful=False)
                    ch = None
        if ch is not None:
            return False
        self.channel = self.sender._connect(self.peer)
        self.last_used = time.monotonic()
        self.sender._stats.bump("channels_opened")
        return True

    def _teardown(self, graceful: bool) -> None:
        ch, self.channel = self.channel, None
        if ch is None:
            return
        try:
            ch.close(graceful)
        except Exception:  # noqa: BLE001 - closing a broken channel must not raise
            log.debug("closing KV channel to %s raised", self.peer, exc_info=True)
        self.sender._stats.bump("channels_closed")

    def _finish(self, job: _Job, ack: Ack, started: float) -> None:
        h = job.header
        ms = (time.monotonic() - started) * 1e3
        if ack.transfer_id != h.transfer_id:
            err = KVTransferError(f"ack for transfer {ack.transfer_id}, expected {h.transfer_id}")
            self._fail(job, err, started)
            return
        if ack.status is AckStatus.OK:
            record = TransferRecord(h.transfer_id, h.payload_bytes, ms, TransferOutcome.OK)
        elif ack.status is AckStatus.NOT_RESERVED:
            record = TransferRecord(
                h.transfer_id,
                0,
                ms,
                TransferOutcome.DROPPED,
                error=f"receiver {self.peer} holds no reservation for transfer {h.transfer_id}",
            )
        else:
            err = KVTransferError(
                f"receiver {self.peer} rejected transfer {h.transfer_id}: {ack.status.name}"
            )
            self._fail(job, err, started)
            return
        self.sender._stats.add_record(record)
        job.future.set_result(record)

    def _fail(
        self, job: _Job, error: KVTransferError, started: float | None = None
    ) -> KVTransferError:
        """Fail ``job`` with ``error`` (its record attached); ms since ``started``, else 0."""
        outcome = (
            TransferOutcome.TIMEOUT
            if isinstance(error, TransferTimeoutError)
            else TransferOutcome.FAILED
        )
        record = TransferRecord(
            job.header.transfer_id,
            0,
            (time.monotonic() - started) * 1e3 if started is not None else 0.0,
            outcome,
            error=str(error),
        )
        self.sender._stats.add_record(record)
        error.record = record
        job.future.set_exception(error)
        return error

    def _fail_queued(self, cause: KVTransferError) -> bool:
        """Fail every queued job because of ``cause``; True if a stop request was queued."""
        stop = False
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return stop
            if job is None:
                stop = True
                continue
            if not job.future.set_running_or_notify_cancel():
                continue
            cls = (
                LayoutMismatchError
                if isinstance(cause, LayoutMismatchError)
                else ChannelClosedError
            )
            err = cls(f"not sent: the channel to {self.peer} failed earlier ({cause})")
            self._fail(job, err)
