"""KV channels over ``torch.distributed`` pair groups: gloo for CPU tensors, NCCL for CUDA.

Pairing (the decode worker's receiver hosts a ``TCPStore`` at its endpoint)::

    sender                                         receiver (store master, accept thread)
    n = add("pdkv/pairs", 1); pair = "pdkv/pair<n>/"
    queue_push("pdkv/hello", {pair, layout, wire,   ──>  queue_pop: check the token, compare
                              token})                     layouts and wire
    wait(pair + "answer")                           <──  set(pair + "answer", {ok | error, idle})
    delete_key(pair + "answer")
    PairGroup(rank 1) on PrefixStore(pair)          <─>  PairGroup(rank 0) in a channel thread

then per transfer the messages of :mod:`kv_transfer.wire` on that group. A refused pairing
(layout or wire backend mismatch) fails the sender's transfer with LayoutMismatchError and is
logged and counted (``handshake_failures``, ``last_error``) on the receiver. With an internal
token (``auth_token``, pdserve/auth.py) the receiver refuses a hello that does not carry it
(constant-time check) before looking at anything else: the sender gets UnauthenticatedError, the
receiver counts a handshake failure and builds no channel; the token is never logged.

Addresses (multi-node): the receiver's store listens on ``bind_host`` (default ``host``) and its
endpoint advertises ``host``; each side's gloo device listens on the local address that routes to
the peer, or on ``GLOO_SOCKET_IFNAME`` (kv_transfer/address.py).

Each channel thread waits for the next header for at most ``idle_timeout_s``, then closes the
channel; senders rebuild channels idle for half that long before using them, so an idle close
never costs a transfer. NOTE: after :meth:`TorchDistReceiver.close` a channel thread may stay
blocked in its header wait until that idle timeout (gloo offers no way to wake it); it holds no
port and exits on its own.

NOTE: a little over 450 lines on purpose: sender and receiver are the two halves of one pairing
handshake, kept side by side so a protocol change edits both in one place.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import QueueEmptyError, TCPStore

from kv_transfer.address import local_address_toward, store_listen_socket
from kv_transfer.base import (
    ChannelClosedError,
    KVLayout,
    KVReceiver,
    KVTransferError,
    LayoutMismatchError,
    StatsCounter,
    TransferResult,
    TransferStats,
    TransferTimeoutError,
    UnauthenticatedError,
    mismatch_message,
)
from kv_transfer.pair_group import (
    RECEIVER_RANK,
    SENDER_RANK,
    TAG_ACK,
    TAG_HEADER,
    TAG_PAYLOAD,
    PairGroup,
    classify,
    parse_endpoint,
    wire_backend,
)
from kv_transfer.receiver_core import ReceiverCore
from kv_transfer.sender_core import PeerChannel, QueuedSender, StaleChannelError
from kv_transfer.wire import (
    ACK_SLOTS,
    HEADER_SLOTS,
    Ack,
    AckStatus,
    Header,
    MessageKind,
    ProtocolError,
)
from pdserve.auth import secrets_match

if TYPE_CHECKING:
    from pdserve.engine.faults import FaultInjector
    from pdserve.kv_cache.pool import KVPool

log = logging.getLogger(__name__)

HELLO_QUEUE = "pdkv/hello"
PAIR_COUNTER = "pdkv/pairs"
ACCEPT_POLL_S = 0.02  # how often the accept thread looks for new senders (adds to connect time)
CLOSE_TIMEOUT_S = 2.0  # bound on the goodbye header of a graceful close
CLOSE_JOIN_S = 5.0  # how long close() waits for channel threads to finish their teardown
CLOSE_GRACE_S = 0.2  # ... and for idle ones, in case a goodbye header is arriving


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeoutError("KV transfer deadline passed")
    return left


# ------------------------------------------------------------------------------------ sender
class _Channel(PeerChannel):
    """The sender's end of one pair group."""

    def __init__(self, group: PairGroup, store: TCPStore, idle_limit_s: float) -> None:
        self.group = group
        self.store = store  # keeps the store connection open for the group's lifetime
        self.idle_limit_s = idle_limit_s

    def transfer(self, header: Header, payload: torch.Tensor, deadline: float) -> Ack:
        g, dev = self.group, self.group.device
        # Post the ack receive and the payload send up front: each message then flows as soon
        # as the receiver is ready for it, without a wake-up of this thread in between.
        ack = torch.zeros(ACK_SLOTS, dtype=torch.int64, device=dev)
        try:
            ack_recv = g.post("recv", ack, TAG_ACK)
            head = g.post("send", header.to_tensor(dev), TAG_HEADER)
            body = g.post("send", payload, TAG_PAYLOAD) if header.payload_bytes else None
            g.wait(head, _remaining(deadline))
        except ChannelClosedError as e:
            # The receiver only drops a channel while waiting for a header (idle or closing)
            # or after it died: it did not take this transfer.
            raise StaleChannelError(str(e)) from e
        if body is not None:
            g.wait(body, _remaining(deadline))
        g.wait(ack_recv, _remaining(deadline))
        return Ack.from_tensor(ack)

    def ping(self, deadline: float) -> None:
        g, dev = self.group, self.group.device
        ack = torch.zeros(ACK_SLOTS, dtype=torch.int64, device=dev)
        ack_recv = g.post("recv", ack, TAG_ACK)
        g.send(Header(kind=MessageKind.PING).to_tensor(dev), TAG_HEADER, _remaining(deadline))
        g.wait(ack_recv, _remaining(deadline))
        Ack.from_tensor(ack)

    def close(self, graceful: bool) -> None:
        if graceful and not self.group.broken:
            try:
                bye = Header(kind=MessageKind.CLOSE).to_tensor(self.group.device)
                self.group.send(bye, TAG_HEADER, CLOSE_TIMEOUT_S)
            except KVTransferError:
                pass
        self.group.abort()


class TorchDistSender(QueuedSender):
    """Sends KV over one pair group per decode worker (see :class:`QueuedSender`).

    ``device``: 'cpu' (gloo) or a CUDA device (NCCL); ``kv`` passed to ``send`` must live there.
    ``faults``: fault injection (see :class:`QueuedSender`).
    ``auth_token``: the internal token presented in every hello (None = none). ``host``: this
    worker's own address, where its gloo socket listens (None = the local address that routes
    to each peer).
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        device: str | torch.device = "cpu",
        timeout_s: float = 30.0,
        checksum: bool = False,
        ping_after_idle_s: float = 1.0,
        auth_token: str | None = None,
        host: str | None = None,
        faults: FaultInjector | None = None,
    ) -> None:
        super().__init__(
            layout,
            device=device,
            timeout_s=timeout_s,
            checksum=checksum,
            ping_after_idle_s=ping_after_idle_s,
            faults=faults,
        )
        self.wire = wire_backend(self.device)
        self._who = f"{socket.gethostname()}:{os.getpid()}"
        self._token = auth_token or ""
        self._host = host

    def _check_peer(self, peer: str) -> None:
        parse_endpoint(peer)

    def _connect(self, peer: str) -> PeerChannel:
        host, port = parse_endpoint(peer)
        timeout = timedelta(seconds=self.timeout_s)
        try:
            store = TCPStore(host, port, None, False, timeout, wait_for_workers=False)
            pair = f"pdkv/pair{store.add(PAIR_COUNTER, 1)}/"
            hello = {
                "pair": pair,
                "layout": self.layout.to_dict(),
                "wire": self.wire,
                "sender": self._who,
                "token": self._token,
            }
            store.queue_push(HELLO_QUEUE, json.dumps(hello))
            store.wait([pair + "answer"], timeout)
            answer = json.loads(store.get(pair + "answer"))
            store.delete_key(pair + "answer")  # read once: leave nothing in the receiver's store
        except RuntimeError as e:
            raise classify(e, f"pairing with KV receiver {peer}") from e
        if answer.get("unauthenticated"):
            raise UnauthenticatedError(f"KV receiver {peer} refused to pair: {answer.get('error')}")
        if not answer.get("ok"):
            raise LayoutMismatchError(f"KV receiver {peer} refused to pair: {answer.get('error')}")
        group = PairGroup(
            store,
            pair,
            SENDER_RANK,
            self.device,
            self._host or local_address_toward(host),
            self.timeout_s,
        )
        return _Channel(group, store, float(answer["idle_timeout_s"]) / 2)


# ---------------------------------------------------------------------------------- receiver
class TorchDistReceiver(KVReceiver):
    """Receives KV from any number of senders into ``pool`` (see the module docstring).

    ``host``/``port``: the address advertised in :attr:`endpoint` and the port the TCPStore
    listens on (0 = a free port); ``bind_host``: where it listens (default ``host``; a wildcard
    such as 0.0.0.0 listens on every interface). ``auth_token``: hellos must carry it (None =
    no check).
    ``timeout_s``: bound on pairing and on each payload receive / ack send.
    ``idle_timeout_s``: a channel with no header for this long is closed (senders reconnect).
    ``on_header``: fault injection for tests, called with each TRANSFER header before its payload
    is received. Raises KVTransferError when the port cannot be bound, ValueError when ``layout``
    does not describe ``pool``.
    """

    def __init__(
        self,
        pool: KVPool,
        layout: KVLayout,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 30.0,
        idle_timeout_s: float = 300.0,
        on_header: Callable[[Header], None] | None = None,
        bind_host: str | None = None,
        auth_token: str | None = None,
    ) -> None:
        if not timeout_s > 0 or not idle_timeout_s > 0:
            raise ValueError(f"timeout_s ({timeout_s}) and idle_timeout_s must be > 0")
        self.layout = layout
        self.host = host
        self.device = torch.device(pool.device)
        self.wire = wire_backend(self.device)
        self.timeout_s = float(timeout_s)
        self.idle_timeout_s = float(idle_timeout_s)
        self._on_header = on_header
        self._token = auth_token
        self._stats = StatsCounter()
        self._core = ReceiverCore(pool, layout, self._stats)
        # Largest payload that can fit the pool: a header announcing more is a protocol error.
        self._max_payload = pool.num_blocks * layout.block_size * layout.bytes_per_token
        listen_on = bind_host or host
        try:
            sock = store_listen_socket(listen_on, port)
        except OSError as e:
            raise KVTransferError(f"KV receiver cannot listen on {listen_on}:{port}: {e}") from e
        try:
            # NOTE: the store takes over the listening socket (closed with the store).
            self._store: TCPStore | None = TCPStore(
                host,
                sock.getsockname()[1],
                None,
                True,
                timedelta(seconds=timeout_s),
                wait_for_workers=False,
                master_listen_fd=sock.detach(),
            )
        except RuntimeError as e:
            raise KVTransferError(f"KV receiver cannot listen on {listen_on}:{port}: {e}") from e
        self._port = int(self._store.port)
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._groups: set[PairGroup] = set()
        self._threads: set[threading.Thread] = set()  # channel threads still running
        self._idle: set[threading.Thread] = set()  # those waiting for the next header
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"kv-accept-{self._port}", daemon=True
        )
        self._accept_thread.start()

    @property
    def endpoint(self) -> str:
        """'host:port' senders connect to."""
        return f"{self.host}:{self._port}"

    def expect(
        self, transfer_id: int, block_ids: Sequence[int], deadline: float
    ) -> Future[TransferResult]:
        """See :meth:`kv_transfer.base.KVReceiver.expect`."""
        return self._core.expect(transfer_id, block_ids, deadline)

    def cancel(self, transfer_id: int) -> bool:
        """See :meth:`kv_transfer.base.KVReceiver.cancel`."""
        return self._core.cancel(transfer_id)

    def stats(self) -> TransferStats:
        """Counters since start."""
        return self._stats.snapshot()

    def num_channels(self) -> int:
        """Channels currently open."""
        with self._lock:
            return len(self._groups)

    def close(self) -> None:
        """Stop accepting, close every channel, fail pending reservations, free the port."""
        self._closing.set()
        self._accept_thread.join(timeout=5.0)
        self._core.close()
        with self._lock:
            groups = list(self._groups)
            threads = list(self._threads)
        for g in groups:
            g.abort()
        # Let channels that are tearing down finish here: a process that exits while a thread
        # is still destroying its gloo group aborts ("terminate called without an active
        # exception"). Threads blocked in an idle header wait cannot be woken; they stay, but
        # get a moment to see a goodbye header already on its way.
        start = time.monotonic()
        while True:
            with self._lock:
                alive = [t for t in threads if t in self._threads]
                busy = [t for t in alive if t not in self._idle]
            elapsed = time.monotonic() - start
            if not alive or elapsed > CLOSE_JOIN_S or (not busy and elapsed > CLOSE_GRACE_S):
                break
            time.sleep(0.01)
        self._store = None  # the master store's server stops with its last reference

    # ----------------------------------------------------------------------------- threads
    def _accept_loop(self) -> None:
        store = self._store
        assert store is not None
        while not self._closing.is_set():
            try:
                raw = store.queue_pop(HELLO_QUEUE, block=False)
            except QueueEmptyError:
                self._closing.wait(ACCEPT_POLL_S)
                continue
            except RuntimeError:
                if self._closing.is_set():
                    return
                log.exception("KV receiver %s: reading the hello queue failed", self.endpoint)
                self._closing.wait(ACCEPT_POLL_S)
                continue
            self._accept(store, raw)

    def _accept(self, store: TCPStore, raw: bytes) -> None:
        """Answer one sender's hello; start its channel thread if the token and layouts agree."""
        try:
            hello: dict[str, Any] = json.loads(raw)
            pair = str(hello["pair"])
            if self._token is not None and not secrets_match(
                str(hello.get("token", "")), self._token
            ):
                self._refuse_unauthenticated(store, pair, str(hello.get("sender")))
                return
            error = mismatch_message(KVLayout.from_dict(hello["layout"]), self.layout)
            if error is None and hello["wire"] != self.wire:
                error = (
                    f"wire backend mismatch: sender={hello['wire']} receiver={self.wire} "
                    f"(KV on {self.device.type} here)"
                )
        except (ValueError, KeyError, TypeError) as e:
            self._stats.bump("handshake_failures", error=f"bad hello: {e}")
            log.error("KV receiver %s: ignoring a bad hello (%s)", self.endpoint, e)
            return
        if error is not None:  # counted before answering, so the sender sees it counted
            self._stats.bump("handshake_failures", error=error)
            log.error("KV receiver %s refused %s: %s", self.endpoint, hello.get("sender"), error)
        answer = {"ok": error is None, "error": error or "", "idle_timeout_s": self.idle_timeout_s}
        try:
            store.set(pair + "answer", json.dumps(answer))
        except RuntimeError as e:
            log.warning("KV receiver %s: cannot answer %s: %s", self.endpoint, pair, e)
            return
        if error is not None:
            return
        thread = threading.Thread(
            target=self._serve_channel,
            args=(pair, str(hello.get("sender"))),
            name=f"kv-recv-{pair}",
            daemon=True,
        )
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _refuse_unauthenticated(self, store: TCPStore, pair: str, who: str) -> None:
        """Answer a hello without the right token: counted and logged (never the token)."""
        error = "missing or incorrect internal token (--internal-token / PDSERVE_INTERNAL_TOKEN)"
        self._stats.bump("handshake_failures", error=f"unauthenticated hello from {who}")
        log.warning("KV receiver %s refused %s: %s", self.endpoint, who, error)
        answer = {"ok": False, "unauthenticated": True, "error": error}
        try:
            store.set(pair + "answer", json.dumps(answer))
        except RuntimeError as e:
            log.warning("KV receiver %s: cannot answer %s: %s", self.endpoint, pair, e)

    def _serve_channel(self, pair: str, who: str) -> None:
        """Channel thread: build the group, then header -> payload -> scatter -> ack, forever."""
        try:
            self._serve_group(pair, who)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _serve_group(self, pair: str, who: str) -> None:
        timeout = timedelta(seconds=self.timeout_s)
        try:
            # The channel's own store connection: a group's rendezvous blocks its client.
            store = TCPStore(self.host, self._port, None, False, timeout, wait_for_workers=False)
            group = PairGroup(store, pair, RECEIVER_RANK, self.device, self.host, self.timeout_s)
        except RuntimeError as e:  # KVTransferError included
            error = e if isinstance(e, KVTransferError) else classify(e, "store connection")
            self._stats.bump("handshake_failures", error=str(error))
            log.warning("KV receiver %s: channel from %s not built: %s", self.endpoint, who, error)
            return
        with self._lock:
            if self._closing.is_set():
                group.abort()
                return
            self._groups.add(group)
        self._stats.bump("channels_opened")
        try:
            self._receive_loop(group)
        except KVTransferError as e:
            if not self._closing.is_set():
                self._stats.bump("channels_closed", error=str(e))
                log.warning("KV channel from %s closed: %s", who, e)
            else:
                self._stats.bump("channels_closed")
        except Exception as e:  # a bug or an allocation failure: log it, close the channel
            self._stats.bump("channels_closed", error=repr(e))
            log.exception("KV channel from %s failed", who)
        else:
            self._stats.bump("channels_closed")
        finally:
            group.abort()
            with self._lock:
                self._groups.discard(group)

    def _receive_loop(self, group: PairGroup) -> None:
        """Serve transfers until the sender says goodbye (returns) or something fails (raises)."""
        dev = self.device
        hdr = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=dev)
        staging = torch.empty(0, dtype=torch.uint8, device=dev)  # reused payload buffer
        me = threading.current_thread()
        while True:
            with self._lock:
                self._idle.add(me)
            try:
                group.recv(hdr, TAG_HEADER, self.idle_timeout_s)
            except TransferTimeoutError:
                log.info("KV channel idle for %.0f s: closing it", self.idle_timeout_s)
                return
            finally:
                with self._lock:
                    self._idle.discard(me)
            header = Header.from_tensor(hdr)
            if header.kind is MessageKind.CLOSE:
                return
            if header.kind is MessageKind.PING:
                group.send(Ack(0, AckStatus.OK).to_tensor(dev), TAG_ACK, self.timeout_s)
                continue
            if header.payload_bytes > self._max_payload:
                raise ProtocolError(
                    f"header announces {header.payload_bytes} bytes; this pool holds at most "
                    f"{self._max_payload}"
                )
            if self._on_header is not None:
                self._on_header(header)
            incoming = self._core.begin(header)
            payload = None
            if header.payload_bytes:
                if staging.numel() < header.payload_bytes:
                    staging = torch.empty(header.payload_bytes, dtype=torch.uint8, device=dev)
                payload = staging[: header.payload_bytes]
                try:
                    group.recv(payload, TAG_PAYLOAD, self.timeout_s)
                except KVTransferError as e:
                    self._core.abandon(incoming, e)
                    raise
            ack = self._core.finish(incoming, payload)
            group.send(ack.to_tensor(dev), TAG_ACK, self.timeout_s)
