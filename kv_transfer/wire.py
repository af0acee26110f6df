"""The bytes a KV channel carries: header, payload, acknowledgement (DESIGN §5).

Per transfer, in order on one channel::

    sender ──header   int64[16]──────────────────────> receiver
    sender ──payload  uint8[payload_bytes] ──────────> receiver   (omitted when payload_bytes = 0)
    sender <──ack     int64[4] ─────────────────────── receiver   (after scatter or drop)

A PING header is answered by an ack (transfer_id 0, OK) and nothing else; a CLOSE header ends
the channel. Header slots: 0 magic ``pdkv``, 1 version, 2 kind (TRANSFER|CLOSE|PING), 3 transfer_id,
4 num_tokens, 5 payload bytes, 6 checksum, 7 flags, 8 first token id, 9 first logprob (float64
bits as int64), 10..15 zero (reserved). Ack slots: 0 transfer_id, 1 :class:`AckStatus`, 2..3 zero.

The payload is the ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` KV viewed as raw
bytes, so every dtype (bfloat16 included) crosses gloo and NCCL as ``uint8``.
The optional checksum is CRC-32 (the ISO 3309 / ITU-T V.42 polynomial, via ``zlib.crc32``) of
those bytes.
"""

from __future__ import annotations

import enum
import operator
import struct
import zlib
from dataclasses import dataclass

import torch

from kv_transfer.base import MAX_TRANSFER_ID, PROTOCOL_VERSION, KVLayout, KVTransferError

HEADER_SLOTS = 16
ACK_SLOTS = 4
MAGIC = int.from_bytes(b"pdkv", "big")
FLAG_CHECKSUM = 1  # header slot 6 holds the payload's CRC-32


class ProtocolError(KVTransferError):
    """The peer sent something that is not a valid message: the channel is out of step."""


class MessageKind(enum.IntEnum):
    """What a header announces."""

    TRANSFER = 1  # a payload follows; answer with an ack
    CLOSE = 2  # the sender is closing the channel; nothing follows
    PING = 3  # liveness check of an idle channel; answer with an ack, no side effect


class AckStatus(enum.IntEnum):
    """The receiver's verdict on one transfer."""

    OK = 0  # scattered into the reserved blocks
    NOT_RESERVED = 1  # drained and dropped: unknown, cancelled or expired transfer_id
    TOO_MANY_TOKENS = 2  # num_tokens exceeds the reserved blocks
    SIZE_MISMATCH = 3  # payload bytes != num_tokens * layout bytes per token
    CHECKSUM_MISMATCH = 4  # payload corrupted in flight
    SCATTER_FAILED = 5  # the pool refused the write


def _float_to_bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", float(x)))[0])


def _bits_to_float(b: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", int(b)))[0])


@dataclass(frozen=True)
class Header:
    """One message header. ``payload_bytes`` of raw KV follow a TRANSFER header."""

    kind: MessageKind
    transfer_id: int = 0
    num_tokens: int = 0
    payload_bytes: int = 0
    checksum: int = 0  # CRC-32 of the payload when ``flags & FLAG_CHECKSUM``
    flags: int = 0
    first_token: int = 0  # token 1 sampled by the prefill worker
    first_logprob: float = 0.0  # its logprob (natural log)
    version: int = PROTOCOL_VERSION

    @property
    def has_checksum(self) -> bool:
        """True when slot 6 carries a checksum to verify."""
        return bool(self.flags & FLAG_CHECKSUM)

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The wire form: int64 ``[HEADER_SLOTS]`` on ``device``."""
        slots = [
            MAGIC,
            self.version,
            int(self.kind),
            self.transfer_id,
            self.num_tokens,
            self.payload_bytes,
            self.checksum,
            self.flags,
            self.first_token,
            _float_to_bits(self.first_logprob),
        ]
        slots += [0] * (HEADER_SLOTS - len(slots))
        return torch.tensor(slots, dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Header:
        """Parse a received header. Raises ProtocolError on a bad magic, version, kind or size."""
        s = [int(v) for v in t.cpu().tolist()]
        if len(s) != HEADER_SLOTS or s[0] != MAGIC:
            raise ProtocolError(f"bad KV header (magic {s[0] if s else None:#x}, {len(s)} slots)")
        if s[1] != PROTOCOL_VERSION:
            raise ProtocolError(
                f"KV protocol version {s[1]} from the peer, this side speaks {PROTOCOL_VERSION}"
            )
        try:
            kind = MessageKind(s[2])
        except ValueError:
            raise ProtocolError(f"unknown KV message kind {s[2]}") from None
        if s[4] < 0 or s[5] < 0 or s[3] < 0:
            raise ProtocolError(f"negative field in KV header {s[:10]}")
        return cls(
            kind=kind,
            transfer_id=s[3],
            num_tokens=s[4],
            payload_bytes=s[5],
            checksum=s[6],
            flags=s[7],
            first_token=s[8],
            first_logprob=_bits_to_float(s[9]),
            version=s[1],
        )


@dataclass(frozen=True)
class Ack:
    """The receiver's answer to one TRANSFER."""

    transfer_id: int
    status: AckStatus

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The wire form: int64 ``[ACK_SLOTS]`` on ``device``."""
        return torch.tensor(
            [self.transfer_id, int(self.status), 0, 0], dtype=torch.int64, device=device
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Ack:
        """Parse a received ack. Raises ProtocolError on an unknown status."""
        s = [int(v) for v in t.cpu().tolist()]
        try:
            return cls(transfer_id=s[0], status=AckStatus(s[1]))
        except (ValueError, IndexError):
            raise ProtocolError(f"bad KV ack {s}") from None


def check_transfer_id(transfer_id: int) -> int:
    """``transfer_id`` as an int in 0..MAX_TRANSFER_ID. Raises ValueError naming the limit."""
    try:
        tid = operator.index(transfer_id)
    except TypeError:
        tid = -1
    if isinstance(transfer_id, bool) or not 0 <= tid <= MAX_TRANSFER_ID:
        raise ValueError(f"transfer_id must be an int in [0, 2**63 - 1], got {transfer_id!r}")
    return tid


def payload_to_wire(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` (any shape, any dtype) as a flat contiguous ``uint8`` view of its bytes."""
    return kv.contiguous().reshape(-1).view(torch.uint8)


def payload_from_wire(buf: torch.Tensor, layout: KVLayout, num_tokens: int) -> torch.Tensor:
    """The first ``num_tokens * layout.bytes_per_token`` bytes of ``buf`` viewed as KV.

    Returns a view ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]`` of ``layout.dtype``
    sharing ``buf``'s memory. Raises ValueError when ``buf`` is too short.
    """
    n = num_tokens * layout.bytes_per_token
    if buf.numel() < n:
        raise ValueError(f"payload buffer holds {buf.numel()} bytes, {n} needed")
    return buf[:n].view(layout.torch_dtype).view(layout.payload_shape(num_tokens))


def checksum(buf: torch.Tensor) -> int:
    """CRC-32 of a ``uint8`` tensor's bytes (copied to the CPU first when on a GPU)."""
    data = buf.detach().cpu().contiguous().numpy()
    return zlib.crc32(data.data) & 0xFFFFFFFF  # ndarray.data: a memoryview, no copy


__all__ = [
    "ACK_SLOTS",
    "FLAG_CHECKSUM",
    "HEADER_SLOTS",
    "MAX_TRANSFER_ID",
    "Ack",
    "AckStatus",
    "Header",
    "MessageKind",
    "ProtocolError",
    "check_transfer_id",
    "checksum",
    "payload_from_wire",
    "payload_to_wire",
]
