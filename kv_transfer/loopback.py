"""In-process KV transport with the torch_dist semantics, for tests of the workers.

Receivers register under ``loopback:<n>`` in a process-wide table; a sender's channel looks the
receiver up, runs the same layout handshake (a mismatch fails both sides, naming the fields),
copies the payload (the "wire") and hands it to the receiver's :class:`ReceiverCore`, which
scatters, drops or rejects it exactly as a torch_dist channel thread would. Ordering, per-peer
queues, records, stats and failure handling come from :class:`QueuedSender`.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from kv_transfer.base import (
    ChannelClosedError,
    KVLayout,
    KVReceiver,
    LayoutMismatchError,
    StatsCounter,
    TransferResult,
    TransferStats,
    mismatch_message,
)
from kv_transfer.receiver_core import ReceiverCore
from kv_transfer.sender_core import PeerChannel, QueuedSender, StaleChannelError
from kv_transfer.wire import Ack, Header

if TYPE_CHECKING:
    from pdserve.kv_cache.pool import KVPool

log = logging.getLogger(__name__)

_registry_lock = threading.Lock()
_registry: dict[str, LoopbackReceiver] = {}
_next_id = itertools.count(1)


class LoopbackReceiver(KVReceiver):
    """An in-process receiver scattering into ``pool``.

    ``port``: 0 = a fresh endpoint ``loopback:<n>``; otherwise ``loopback:<port>``, which must
    not be taken by an open receiver (a "restarted" receiver can reuse a closed one's endpoint).
    ``host``, ``timeout_s``, ``bind_host``, ``auth_token``: accepted for signature parity with
    torch_dist; unused (in-process: nothing to bind, nobody else to keep out).
    Raises ValueError when the endpoint is taken or ``layout`` does not describe ``pool``.
    """

    def __init__(
        self,
        pool: KVPool,
        layout: KVLayout,
        *,
        host: str = "loopback",
        port: int = 0,
        timeout_s: float = 30.0,
        bind_host: str | None = None,
        auth_token: str | None = None,
    ) -> None:
        self.layout = layout
        self.device = torch.device(pool.device)
        self._stats = StatsCounter()
        self._core = ReceiverCore(pool, layout, self._stats)
        self._closed = False
        with _registry_lock:
            n = port or next(_next_id)
            while not port and f"loopback:{n}" in _registry:
                n = next(_next_id)
            self._endpoint = f"loopback:{n}"
            if self._endpoint in _registry:
                raise ValueError(f"loopback endpoint {self._endpoint} is taken")
            _registry[self._endpoint] = self

    @property
    def endpoint(self) -> str:
        """'loopback:<n>'."""
        return self._endpoint

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

    def close(self) -> None:
        """Unregister and fail pending reservations."""
        with _registry_lock:
            self._closed = True
            if _registry.get(self._endpoint) is self:
                del _registry[self._endpoint]
        self._core.close()

    # ------------------------------------------------------------------ called by channels
    def _pair(self, layout: KVLayout) -> None:
        """The handshake. Raises LayoutMismatchError (also counted and logged here)."""
        error = mismatch_message(layout, self.layout)
        if error is not None:
            self._stats.bump("handshake_failures", error=error)
            log.error("loopback KV receiver %s refused a sender: %s", self._endpoint, error)
            raise LayoutMismatchError(f"KV receiver {self._endpoint} refused to pair: {error}")
        self._stats.bump("channels_opened")

    def _deliver(self, header: Header, payload: torch.Tensor) -> Ack:
        """One transfer arriving: the same steps as a torch_dist channel thread."""
        if self._closed:
            raise StaleChannelError(f"loopback KV receiver {self._endpoint} is closed")
        incoming = self._core.begin(header)
        wire = payload.to(self.device, copy=True) if header.payload_bytes else None
        return self._core.finish(incoming, wire)


class _LoopbackChannel(PeerChannel):
    def __init__(self, receiver: LoopbackReceiver) -> None:
        self.receiver = receiver

    def transfer(self, header: Header, payload: torch.Tensor, deadline: float) -> Ack:
        return self.receiver._deliver(header, payload)

    def ping(self, deadline: float) -> None:
        if self.receiver._closed:
            raise ChannelClosedError(f"loopback KV receiver {self.receiver.endpoint} is closed")

    def close(self, graceful: bool) -> None:
        self.receiver._stats.bump("channels_closed")


class LoopbackSender(QueuedSender):
    """Sends KV to :class:`LoopbackReceiver` objects of this process (see QueuedSender).

    ``auth_token``, ``host``: accepted for signature parity with torch_dist; unused (in-process).
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        auth_token: str | None = None,
        host: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(layout, **kwargs)

    def _connect(self, peer: str) -> PeerChannel:
        with _registry_lock:
            receiver = _registry.get(peer)
        if receiver is None:
            raise ChannelClosedError(f"no loopback KV receiver at {peer!r}")
        receiver._pair(self.layout)
        return _LoopbackChannel(receiver)
