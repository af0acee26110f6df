"""Header, ack and payload encodings of the KV channel (kv_transfer.wire)."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch
from kv_transfer_kit import layout, random_kv

from kv_transfer.base import PROTOCOL_VERSION
from kv_transfer.wire import (
    FLAG_CHECKSUM,
    HEADER_SLOTS,
    Ack,
    AckStatus,
    Header,
    MessageKind,
    ProtocolError,
    check_transfer_id,
    checksum,
    payload_from_wire,
    payload_to_wire,
)


@pytest.mark.parametrize("logprob", [0.0, -1.0 / 3.0, -1e-300, -math.inf, -87.25])
def test_header_round_trips_every_field(logprob: float) -> None:
    h = Header(
        kind=MessageKind.TRANSFER,
        transfer_id=2**63 - 1,
        num_tokens=1000,
        payload_bytes=512_000,
        checksum=0xDEADBEEF,
        flags=FLAG_CHECKSUM,
        first_token=49151,
        first_logprob=logprob,
    )
    t = h.to_tensor()
    assert t.dtype == torch.int64 and t.shape == (HEADER_SLOTS,)
    back = Header.from_tensor(t)
    assert back == h and back.has_checksum and back.version == PROTOCOL_VERSION


def test_header_rejects_foreign_or_newer_messages() -> None:
    good = Header(kind=MessageKind.PING).to_tensor()
    bad_magic = good.clone()
    bad_magic[0] = 12345
    with pytest.raises(ProtocolError, match="magic"):
        Header.from_tensor(bad_magic)
    newer = good.clone()
    newer[1] = PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError, match=f"version {PROTOCOL_VERSION + 1}"):
        Header.from_tensor(newer)
    kind = good.clone()
    kind[2] = 77
    with pytest.raises(ProtocolError, match="kind 77"):
        Header.from_tensor(kind)
    negative = Header(kind=MessageKind.TRANSFER, num_tokens=3).to_tensor()
    negative[5] = -1
    with pytest.raises(ProtocolError, match="negative"):
        Header.from_tensor(negative)


def test_ack_round_trip_and_bad_status() -> None:
    ack = Ack(2**62, AckStatus.CHECKSUM_MISMATCH)
    assert Ack.from_tensor(ack.to_tensor()) == ack
    with pytest.raises(ProtocolError, match="bad KV ack"):
        Ack.from_tensor(torch.tensor([1, 99, 0, 0]))


def test_transfer_id_range() -> None:
    assert check_transfer_id(0) == 0
    assert check_transfer_id(np.int64(7)) == 7
    for bad in (-1, 2**63, 1.5, True, "3", None):
        with pytest.raises(ValueError, match=r"transfer_id must be an int in \[0, 2\*\*63 - 1\]"):
            check_transfer_id(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_payload_bytes_view_is_bit_exact(dtype: str) -> None:
    lay = layout(dtype)
    kv = random_kv(lay, 17, seed=1)
    wire = payload_to_wire(kv)
    assert wire.dtype == torch.uint8 and wire.numel() == 17 * lay.bytes_per_token
    back = payload_from_wire(torch.cat([wire, torch.zeros(100, dtype=torch.uint8)]), lay, 17)
    assert back.shape == kv.shape and torch.equal(back, kv)


def test_non_contiguous_payload_is_sent_in_logical_order() -> None:
    lay = layout()
    kv = random_kv(lay, 8, seed=2)
    strided = kv.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    assert not strided.is_contiguous()
    assert torch.equal(payload_to_wire(strided), payload_to_wire(kv))


def test_payload_buffer_too_short() -> None:
    lay = layout()
    with pytest.raises(ValueError, match="holds 10 bytes, 512 needed"):
        payload_from_wire(torch.zeros(10, dtype=torch.uint8), lay, 1)


def test_checksum_is_crc32_and_sees_a_flipped_bit() -> None:
    buf = payload_to_wire(random_kv(layout(), 5, seed=3))
    assert checksum(buf) == zlib.crc32(buf.numpy().tobytes())
    flipped = buf.clone()
    flipped[100] ^= 1
    assert checksum(flipped) != checksum(buf)
