"""Pure metric math on hand-built request outputs (exact, no server)."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import (
    RequestOutput,
    calculate_metrics,
    meets_slos,
    parse_goodput,
    parse_percentiles,
    peak_output_rate,
    percentile_key,
    summarize,
)


def _ok(
    start: float, ttft: float, itl: list[float], tokens: int, prompt: int = 10
) -> RequestOutput:
    return RequestOutput(
        success=True,
        prompt_len=prompt,
        output_tokens=tokens,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        start_time=start,
        num_chunks=len(itl) + 1,
        usage_reported=True,
    )


def _failed(start: float) -> RequestOutput:
    # Timings of a failed request must never leak into the statistics.
    return RequestOutput(success=False, prompt_len=999, output_tokens=0, ttft=50.0,
                         itl=[40.0], latency=90.0, start_time=start, error="HTTP 500")  # fmt: skip


def test_hand_computed_metrics() -> None:
    outs = [
        _ok(0.0, 0.100, [0.010, 0.030], 3),  # TPOT (0.14 - 0.1) / 2 = 0.020
        _ok(0.05, 0.200, [0.020] * 4, 9),  # 4 chunks, 9 tokens: TPOT 0.08 / 8 = 0.010
        _ok(1.0, 0.300, [], 1),  # one token: no TPOT, no ITL
        _failed(0.2),
    ]
    m = calculate_metrics(outs, duration_s=2.0, percentiles=(50, 99))
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input, m.total_output) == (30, 13)
    assert m.request_throughput == 1.5
    assert m.output_throughput == 6.5
    assert m.total_token_throughput == 21.5
    assert m.request_goodput is None and m.good_completed == 3
    ttft = m.stats["ttft"]
    assert ttft.mean == pytest.approx(200.0) and ttft.median == pytest.approx(200.0)
    assert ttft.std == pytest.approx((20000 / 3) ** 0.5)
    assert ttft.percentiles[99.0] == pytest.approx(298.0)  # linear: 200 + 0.98 * 100
    tpot = m.stats["tpot"]
    assert tpot.count == 2 and tpot.mean == pytest.approx(15.0)
    itl = m.stats["itl"]
    assert itl.count == 6 and itl.mean == pytest.approx(120 / 6)
    assert itl.median == pytest.approx(20.0)
    e2el = m.stats["e2el"]
    assert e2el.mean == pytest.approx((140 + 280 + 300) / 3)
    assert m.max_concurrent_requests == 2  # in flight: [0, .14) [.05, .33) [1, 1.3)
    assert m.max_output_tokens_per_s == 8.0  # chunks in second 0: 3 + 5; second 1: 1


def test_goodput_counts_exactly_requests_meeting_all_slos() -> None:
    outs = [
        _ok(0, 0.100, [0.010] * 4, 5),  # ttft 100, tpot 10, e2el 140
        _ok(0, 0.300, [0.010] * 4, 5),  # ttft 300 (misses ttft)
        _ok(0, 0.100, [0.050] * 4, 5),  # tpot 50 (misses tpot)
        _ok(0, 0.100, [0.010] * 40, 41),  # e2el 500 (misses e2el only)
        _ok(0, 0.200, [], 1),  # one token: TPOT counts as 0 for goodput
        _failed(0),  # never good
    ]
    slos = {"ttft": 200.0, "tpot": 20.0, "e2el": 400.0}
    m = calculate_metrics(outs, 4.0, slos_ms=slos)
    assert [meets_slos(o, slos) for o in outs] == [True, False, False, False, True, False]
    assert m.good_completed == 2 and m.request_goodput == 0.5
    # SLO boundaries are inclusive ("<="), as in vLLM.
    assert meets_slos(outs[0], {"ttft": 100.0})
    assert calculate_metrics(outs, 4.0, slos_ms={"ttft": 100.0}).good_completed == 3
    assert calculate_metrics(outs, 4.0, slos_ms={"e2el": 150.0}).good_completed == 1


def test_all_failed_gives_zeros_not_nan() -> None:
    m = calculate_metrics([_failed(0), _failed(1)], 1.0, slos_ms={"ttft": 1})
    assert (m.completed, m.failed, m.good_completed) == (0, 2, 0)
    assert m.stats["ttft"].mean == 0.0 and m.stats["itl"].percentiles[99.0] == 0.0
    assert peak_output_rate([_failed(0)]) == (0.0, 0)


def test_summarize_and_percentile_key() -> None:
    s = summarize([0.001, 0.002, 0.003, 0.004], [25, 50, 100])
    assert s.percentiles == pytest.approx({25.0: 1.75, 50.0: 2.5, 100.0: 4.0})
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"


def test_argument_parsing_errors() -> None:
    assert parse_goodput(["ttft:500", "TPOT:50.5", "e2el:0"]) == {
        "ttft": 500.0, "tpot": 50.5, "e2el": 0.0,
    }  # fmt: skip
    for bad, msg in (("ttft", "NAME:MS"), ("itl:5", "NAME:MS"), ("ttft:x", "not a number"),
                     ("ttft:-1", ">= 0")):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            parse_goodput([bad])
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    for bad in ("", "0", "101", "p99"):
        with pytest.raises(ValueError, match="--percentiles"):
            parse_percentiles(bad)
    with pytest.raises(ValueError, match="duration_s"):
        calculate_metrics([], 0.0)
    with pytest.raises(ValueError, match="goodput SLO 'itl'"):
        calculate_metrics([], 1.0, slos_ms={"itl": 5})
