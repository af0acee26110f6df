"""KVLayout, records, counters and the backend registry (kv_transfer.base, kv_transfer)."""

from __future__ import annotations

import pytest
import torch
from kv_transfer_kit import layout, make_pool

from kv_transfer import get_backend, make_receiver, make_sender
from kv_transfer.base import (
    KVLayout,
    StatsCounter,
    TransferOutcome,
    TransferRecord,
    TransferTimeoutError,
    mismatch_message,
)
from kv_transfer.loopback import LoopbackReceiver, LoopbackSender
from kv_transfer.torch_dist import TorchDistReceiver, TorchDistSender
from pdserve.config import TransferConfig


def test_layout_from_pool_matches_pool_geometry() -> None:
    pool = make_pool(layout("bfloat16"))
    lay = KVLayout.from_pool(pool, "tiny")
    assert lay == layout("bfloat16")
    assert lay.bytes_per_token == pool.bytes_per_token() == 2 * 2 * 2 * 16 * 2
    assert lay.payload_shape(5) == (2, 2, 5, 2, 16)
    assert KVLayout.from_dict(lay.to_dict()) == lay


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dtype", "int8", "KV dtype 'int8'"),
        ("num_layers", 0, "num_layers must be a positive int"),
        ("head_dim", -4, "head_dim must be a positive int"),
        ("block_size", 2.5, "block_size must be a positive int"),
    ],
)
def test_layout_rejects_bad_fields(field: str, value: object, match: str) -> None:
    d = layout().to_dict()
    d[field] = value
    with pytest.raises(ValueError, match=match):
        KVLayout.from_dict(d)


def test_layout_from_dict_names_missing_fields() -> None:
    d = layout().to_dict()
    del d["num_kv_heads"]
    with pytest.raises(ValueError, match=r"missing fields \['num_kv_heads'\]"):
        KVLayout.from_dict(d)


def test_mismatch_message_names_each_differing_field() -> None:
    assert mismatch_message(layout(), layout()) is None
    msg = mismatch_message(layout("bfloat16", head_dim=32), layout("float32", head_dim=16))
    assert msg is not None
    assert "dtype sender='bfloat16' receiver='float32'" in msg
    assert "head_dim sender=32 receiver=16" in msg
    assert "num_layers" not in msg.split("(")[0]


def test_stats_counter_by_outcome() -> None:
    c = StatsCounter()
    c.add_record(TransferRecord(1, 2_000_000, 2.0, TransferOutcome.OK))
    c.add_record(TransferRecord(2, 0, 0.1, TransferOutcome.DROPPED, error="no reservation"))
    c.add_record(TransferRecord(3, 0, 5.0, TransferOutcome.TIMEOUT, error="timed out"))
    c.add_record(TransferRecord(4, 0, 1.0, TransferOutcome.FAILED, error="closed"))
    c.bump("channels_opened")
    s = c.snapshot()
    assert (s.transfers_ok, s.transfers_dropped, s.transfers_timeout, s.transfers_failed) == (
        1,
        1,
        1,
        1,
    )
    assert s.failures == 2 and s.bytes == 2_000_000 and s.ms == 2.0
    assert s.gbps == pytest.approx(1.0) and s.channels_opened == 1 and s.last_error == "closed"


def test_outcome_prints_as_its_wire_value() -> None:
    assert str(TransferOutcome.DROPPED) == "dropped" and TransferOutcome.OK == "ok"
    assert isinstance(TransferTimeoutError("x"), TimeoutError)


def test_registry_builds_each_backend_by_name() -> None:
    assert get_backend("torch_dist").sender is TorchDistSender
    assert get_backend("torch_dist").receiver is TorchDistReceiver
    lay = layout()
    pool = make_pool(lay)
    rx = make_receiver(TransferConfig(backend="loopback"), pool, lay)
    tx = make_sender(TransferConfig(backend="loopback", checksum=True), lay)
    try:
        assert isinstance(rx, LoopbackReceiver) and isinstance(tx, LoopbackSender)
        assert rx.endpoint.startswith("loopback:") and tx.checksum
    finally:
        tx.close()
        rx.close()
    rx2 = make_receiver(TransferConfig(backend="torch_dist", host="127.0.0.1"), pool, lay)
    try:
        assert rx2.endpoint.startswith("127.0.0.1:")
    finally:
        rx2.close()


def test_registry_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match=r"'carrier_pigeon' is not one of \['loopback'"):
        get_backend("carrier_pigeon")


def test_layout_must_describe_the_receivers_pool() -> None:
    pool = make_pool(layout(head_dim=16))
    with pytest.raises(ValueError, match=r"does not describe the pool \(fields \['head_dim'\]\)"):
        LoopbackReceiver(pool, layout(head_dim=32))
    assert torch.count_nonzero(pool.kv) == 0
