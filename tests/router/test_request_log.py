"""Request records: bounded ring, lookup by request id or response id, status."""

from __future__ import annotations

import pytest

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
