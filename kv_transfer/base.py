"""KV transfer interfaces: what a prefill worker's sender and a decode worker's receiver promise.

A KV transfer moves one prompt's KV cache ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``
from a prefill worker to the blocks a decode worker reserved for it (DESIGN §5).

Lifecycle of one transfer on the receiver (decode) side::

    expect(transfer_id, block_ids, deadline) ──> RESERVED ──header──> TRANSFERRING ──> DONE
        RESERVED | TRANSFERRING ──cancel()──> CANCELLED      (future cancelled)
        RESERVED | TRANSFERRING ──deadline──> EXPIRED        (future fails, TransferExpiredError)
        TRANSFERRING ──bad payload──> FAILED                 (future fails, KVTransferError)
        TRANSFERRING ──channel broke──> RESERVED             (a retry may still fill the blocks)

and on the sender (prefill) side::

    send(peer, transfer_id, kv, ...) ──> QUEUED ──> TRANSFERRING ──ack──> DONE | DROPPED
        QUEUED | TRANSFERRING ──timeout / channel broke / rejected──> FAILED

NOTE: once ``cancel`` returns, or a reservation's future has failed, the receiver never writes
to that reservation's blocks again, so the engine may free them at once.

Backends (``torch_dist``, ``loopback``) implement :class:`KVSender` / :class:`KVReceiver`; the
package's ``make_sender`` / ``make_receiver`` pick one by name.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from pdserve.types import TransferOutcome, TransferRecord  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from pdserve.kv_cache.pool import KVPool

PROTOCOL_VERSION = 1
"""Version of the header/ack wire format and handshake; both sides must agree."""

MAX_TRANSFER_ID = 2**63 - 1
"""Transfer ids travel in an int64 header slot: valid ids are 0..MAX_TRANSFER_ID."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' | 'bfloat16' | 'float16' for a torch dtype. Raises ValueError for others."""
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} is not supported; choose one of {sorted(_DTYPES)}")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (see :func:`dtype_name`). Raises ValueError."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"KV dtype {name!r} is not one of {sorted(_DTYPES)}") from None


# ------------------------------------------------------------------------------------- errors
class KVTransferError(RuntimeError):
    """A KV transfer failed. ``record`` is the failed transfer's record when one exists."""

    def __init__(self, message: str, record: TransferRecord | None = None) -> None:
        super().__init__(message)
        self.record = record


class LayoutMismatchError(KVTransferError):
    """Sender and receiver KV layouts differ; the message names each differing field."""


class UnauthenticatedError(LayoutMismatchError):
    """The receiver refused to pair: the sender's internal token is missing or wrong.

    A refused pairing like a layout mismatch (counted as a handshake failure, never retried).
    """


class ChannelClosedError(KVTransferError):
    """The channel to the peer broke or was closed (peer died, closed, or failed a handshake)."""


class TransferTimeoutError(KVTransferError, TimeoutError):
    """A send or receive did not complete within its timeout; the channel was torn down."""


class TransferExpiredError(KVTransferError, TimeoutError):
    """A reservation's deadline passed before its KV arrived; its blocks may be freed."""


# ------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class KVLayout:
    """What both ends of a channel must agree on before any KV moves (DESIGN §5 handshake).

    The payload of a transfer is ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` of
    ``dtype``; ``block_size`` (tokens per block) and ``model_id`` guard against pairing workers
    that serve different models or cache geometries.
    """

    model_id: str  # names the weights, e.g. ModelConfig.model_id
    dtype: str  # 'float32' | 'bfloat16' | 'float16'
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  # tokens per KV block
    protocol_version: int = PROTOCOL_VERSION

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")

    @classmethod
    def from_pool(cls, pool: KVPool, model_id: str) -> KVLayout:
        """The layout of a :class:`~pdserve.kv_cache.pool.KVPool` serving ``model_id``."""
        return cls(
            model_id=model_id,
            dtype=dtype_name(pool.dtype),
            num_layers=pool.num_layers,
            num_kv_heads=pool.num_kv_heads,
            head_dim=pool.head_dim,
            block_size=pool.block_size,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The payload's torch dtype."""
        return torch_dtype(self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Payload bytes per token: 2 * layers * kv_heads * head_dim * element bytes."""
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    def payload_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """``(num_layers, 2, num_tokens, num_kv_heads, head_dim)``."""
        return (self.num_layers, 2, num_tokens, self.num_kv_heads, self.head_dim)

    def differences(self, other: KVLayout) -> list[str]:
        """Names of the fields whose values differ (empty when compatible)."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the handshake carries it)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        """Inverse of :meth:`to_dict`. Raises ValueError on a missing or bad field."""
        names = {f.name for f in fields(cls)}
        missing = sorted(n for n in names if n not in d and n != "protocol_version")
        if missing:
            raise ValueError(f"KV layout is missing fields {missing}")
        return cls(**{k: v for k, v in d.items() if k in names})


def mismatch_message(sender: KVLayout, receiver: KVLayout) -> str | None:
    """The error text for a refused pairing, naming each differing field, or None if equal."""
    diffs = sender.differences(receiver)
    if not diffs:
        return None
    parts = [f"{n} sender={getattr(sender, n)!r} receiver={getattr(receiver, n)!r}" for n in diffs]
    return f"KV layout mismatch: {'; '.join(parts)} (sender {sender}; receiver {receiver})"


# ---------------------------------------------------------------------------- states, records
class TransferState(str, enum.Enum):
    """Where one transfer is in its lifecycle (see the module docstring)."""

    QUEUED = "queued"  # sender: waiting behind earlier transfers on the channel
    RESERVED = "reserved"  # receiver: blocks reserved, nothing arrived yet
    TRANSFERRING = "transferring"  # header sent / received, payload in flight
    DONE = "done"  # receiver: KV in the blocks; sender: receiver acknowledged it
    DROPPED = "dropped"  # receiver had no reservation (unknown, cancelled, expired)
    FAILED = "failed"  # timeout, broken channel, bad payload
    CANCELLED = "cancelled"  # receiver: cancel() before the KV arrived
    EXPIRED = "expired"  # receiver: deadline passed before the KV arrived

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class TransferResult:
    """What a receiver's future resolves to once the KV is in the reserved blocks."""

    transfer_id: int
    num_tokens: int  # tokens of KV written, from the header
    block_ids: tuple[int, ...]  # the reserved blocks (the first ceil(num_tokens/bs) hold KV)
    first_token: int  # token 1, sampled by the prefill worker (header)
    first_logprob: float  # its log-probability, natural log (header)
    record: TransferRecord


# ---------------------------------------------------------------------------------- counters
@dataclass(frozen=True)
class TransferStats:
    """Counters of one sender or receiver since it started (a snapshot; feeds metrics).

    ``transfers_*`` count finished transfers by outcome; ``bytes``/``ms`` sum the payload bytes
    and wall milliseconds of the ``ok`` ones.
    """

    transfers_ok: int = 0
    transfers_dropped: int = 0
    transfers_failed: int = 0
    transfers_timeout: int = 0
    bytes: int = 0
    ms: float = 0.0
    channels_opened: int = 0
    channels_closed: int = 0  # torn down after an error, idle time, or close()
    handshake_failures: int = 0  # refused pairings (layout mismatch, bad hello)
    reservations_cancelled: int = 0  # receiver only
    reservations_expired: int = 0  # receiver only
    last_error: str = ""

    @property
    def failures(self) -> int:
        """Transfers that failed or timed out."""
        return self.transfers_failed + self.transfers_timeout

    @property
    def gbps(self) -> float:
        """Mean throughput of the ok transfers in GB/s (1e9 bytes/s); 0 before any."""
        return self.bytes / self.ms / 1e6 if self.ms > 0 else 0.0


class StatsCounter:
    """Thread-safe accumulator behind :class:`TransferStats`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = TransferStats()

    def add_record(self, record: TransferRecord) -> None:
        """Count a finished transfer by its outcome."""
        s = self._stats
        with self._lock:
            if record.outcome is TransferOutcome.OK:
                s = replace(
                    s,
                    transfers_ok=s.transfers_ok + 1,
                    bytes=s.bytes + record.bytes,
                    ms=s.ms + record.ms,
                )
            elif record.outcome is TransferOutcome.DROPPED:
                s = replace(s, transfers_dropped=s.transfers_dropped + 1)
            elif record.outcome is TransferOutcome.TIMEOUT:
                s = replace(s, transfers_timeout=s.transfers_timeout + 1, last_error=record.error)
            else:
                s = replace(s, transfers_failed=s.transfers_failed + 1, last_error=record.error)
            self._stats = s

    def bump(self, name: str, error: str = "") -> None:
        """Add 1 to the integer counter ``name``; remember ``error`` as ``last_error`` if given."""
        with self._lock:
            changes: dict[str, Any] = {name: getattr(self._stats, name) + 1}
            if error:
                changes["last_error"] = error
            self._stats = replace(self._stats, **changes)

    def snapshot(self) -> TransferStats:
        """The counters now."""
        with self._lock:
            return self._stats


# ------------------------------------------------------------------------------- interfaces
class KVSender(ABC):
    """The prefill side: sends gathered KV to decode workers, one ordered queue per peer."""

    layout: KVLayout

    @abstractmethod
    def send(
        self,
        peer_endpoint: str,
        transfer_id: int,
        kv: torch.Tensor,
        first_token: int,
        first_logprob: float = 0.0,
    ) -> Future[TransferRecord]:
        """Queue ``kv`` ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` for ``peer_endpoint``.

        The future resolves to the record once the receiver acknowledged the transfer: outcome
        ``ok`` (scattered into the reserved blocks) or ``dropped`` (no reservation for the id).
        It fails with :class:`KVTransferError` (``.record`` set; :class:`TransferTimeoutError`,
        :class:`ChannelClosedError`, :class:`LayoutMismatchError` for the specific causes).
        ``kv`` must not be modified until the future is done. Cancelling the future before the
        transfer started skips it (nothing reaches the peer). Raises ValueError at once on a
        bad argument (shape, dtype, device, id range), naming it.
        """

    @abstractmethod
    def stats(self) -> TransferStats:
        """Counters since start."""

    @abstractmethod
    def close(self) -> None:
        """Close every channel; queued transfers fail with :class:`ChannelClosedError`."""


class KVReceiver(ABC):
    """The decode side: reserves destinations and scatters arriving KV into its pool."""

    layout: KVLayout

    @property
    @abstractmethod
    def endpoint(self) -> str:
        """Where senders reach this receiver ('host:port' for torch_dist)."""

    @abstractmethod
    def expect(
        self, transfer_id: int, block_ids: Sequence[int], deadline: float
    ) -> Future[TransferResult]:
        """Reserve ``block_ids`` for ``transfer_id`` until ``deadline`` (``time.time()`` seconds).

        The future resolves to a :class:`TransferResult` once the KV is scattered; fails with
        :class:`TransferExpiredError` at the deadline, :class:`KVTransferError` on a bad payload
        or when the receiver closes; is cancelled by :meth:`cancel`. Raises ValueError on a bad
        argument (id range, duplicate id, block id outside the pool, deadline passed).
        """

    @abstractmethod
    def cancel(self, transfer_id: int) -> bool:
        """Forget the reservation (its KV will be drained and dropped). False if not reserved."""

    @abstractmethod
    def stats(self) -> TransferStats:
        """Counters since start."""

    @abstractmethod
    def close(self) -> None:
        """Stop accepting, close channels, fail pending reservations with ChannelClosedError."""
