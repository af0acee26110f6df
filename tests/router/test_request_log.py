"""Request records: bounded ring, lookup by request id or response id, status."""

from __future__ import annotations

import pytest

from pdserve.v1 import worker_pb2 as pb
from router.request_log import RequestLog

pytestmark = pytest.mark.timeout(30)


def test_ring_keeps_the_last_n_and_forgets_their_aliases() -> None:
    log = RequestLog(capacity=3)
    for i in range(5):
        rec = log.open(f"req-{i}", f"cmpl-{i}", 0.0, prompt_tokens=4, n=1)
        seq = rec.add_sequence(f"cmpl-{i}", 0, 4, 16)
        seq.ended("finished", "length", 2, "")
        log.close(rec)
    assert [r.request_id for r in log.recent(10)] == ["req-4", "req-3", "req-2"]
    assert log.get("req-1") is None and log.get("cmpl-1") is None
    got = log.get("cmpl-3")
    assert got is not None and got.request_id == "req-3" and got.status == "finished"
    assert log.num_live == 0


def test_multi_prompt_request_shares_one_record_until_its_last_stream_closes() -> None:
    log = RequestLog()
    a = log.open("req-x", "cmpl-x-p0", 0.0, prompt_tokens=3, n=1)
    b = log.open("req-x", "cmpl-x-p1", 0.0, prompt_tokens=5, n=1)
    assert a is b and a.prompt_tokens == 8 and log.num_live == 1
    a.add_sequence("cmpl-x-p0", 0, 3, 16).ended("finished", "stop", 1, "")
    a.add_sequence("cmpl-x-p1", 0, 5, 16)
    log.close(a)
    assert a.status == "running" and log.get("cmpl-x-p1") is a
    a.sequences[1].ended("aborted", None, 0, "client disconnected")
    log.close(a)
    assert log.num_live == 0 and a.status == "aborted"


def test_rejected_request_is_recorded() -> None:
    log = RequestLog()
    log.reject("req-r", "cmpl-r", 7, "the server is busy")
    rec = log.get("cmpl-r")
    assert rec is not None and rec.status == "rejected"
    assert rec.summary()["rejected"] == "the server is busy"


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity"):
        RequestLog(capacity=0)


def test_requests_sharing_a_client_id_keep_records_of_their_own() -> None:
    """Two client requests with one x-request-id (different scopes) get separate records: one
    client's disconnect does not show the other aborted; the plain id finds the newest, each
    response id its own, and the later one's key is '<id>~2'."""
    log = RequestLog(capacity=2)
    first, second = object(), object()
    a = log.open("dup", "chatcmpl-a", 0.0, prompt_tokens=3, n=1, scope=first)
    b = log.open("dup", "chatcmpl-b", 0.0, prompt_tokens=4, n=1, scope=second)
    assert a is not b and (a.key, b.key) == ("dup", "dup~2") and log.num_live == 2
    a.add_sequence("chatcmpl-a", 0, 3, 16).ended("aborted", None, 1, "client disconnected")
    b.add_sequence("chatcmpl-b", 0, 4, 16)
    log.close(a)
    assert a.status == "aborted" and b.status == "running"
    assert log.get("dup") is b and log.get("chatcmpl-a") is a and log.get("dup~2") is b
    b.sequences[0].ended("finished", "stop", 2, "")
    log.close(b)
    assert b.status == "finished" and log.get("dup") is b and log.get("dup~1") is None
    assert [r["id"] for r in (b.summary(), a.summary())] == ["dup~2", "dup"]
    assert b.summary()["request_id"] == "dup"
    c = log.open("dup", "chatcmpl-c", 0.0, prompt_tokens=1, n=1, scope=object())
    assert c.key == "dup~3" and log.get("dup") is c
    log.reject("dup", "chatcmpl-d", 2, "busy", scope=object())  # a fourth, refused
    d = log.get("chatcmpl-d")
    assert d is not None and d.key == "dup~4" and d.status == "rejected" and log.get("dup") is d
    log.close(c)  # the ring keeps 2: dup~4 and dup~3; "dup" and "dup~2" are gone
    assert log.get("chatcmpl-a") is None and log.get("chatcmpl-b") is None
    assert log.get("dup~3") is c


def test_transfer_record_of_a_partial_last_block() -> None:
    """``bytes_per_block`` is what one full KV block holds (block_size tokens), the same for
    every transfer of a model; ``bytes`` is what moved, the prompt's tokens only, so a partial
    last block makes it less than blocks x bytes_per_block. Nothing moved: null."""
    per_token = 100  # KV bytes of one token (all layers, K and V)
    rec = RequestLog().open("req-p", "cmpl-p", 0.0, prompt_tokens=33, n=1)
    seq = rec.add_sequence("cmpl-p", 0, 33, 16)
    ok = pb.TransferRecord(transfer_id=1, bytes=33 * per_token, ms=2.0, outcome="ok")
    seq.prefill_done("prefill-0", pb.PrefillResponse(transfer=ok), 33)
    failed = pb.TransferRecord(transfer_id=2, outcome="failed", error="channel closed")
    seq.prefill_done("prefill-1", pb.PrefillResponse(transfer=failed), 33)
    done, lost = seq.transfers
    assert (done["tokens"], done["blocks"], done["bytes"]) == (33, 3, 3300)
    assert done["bytes_per_block"] == 16 * per_token  # capacity, not 3300 / 3 = 1100
    assert done["bytes"] == 2 * done["bytes_per_block"] + 1 * per_token
    assert lost["bytes"] == 0 and lost["bytes_per_block"] is None and lost["outcome"] == "failed"
