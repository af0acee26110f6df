"""Mixed traffic (pdserve.bench.suite.mixed) against the scripted fake server: both clients start
together, the long client stops sending when the short run ends and waits for what it sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from conftest import FakeServer

from pdserve.bench.datasets import SampleRequest
from pdserve.bench.serve import BenchConfig, BenchmarkError
from pdserve.bench.suite.mixed import UNFINISHED, LongPrompts, run_mixed, run_paced_until
from pdserve.bench.suite.workloads import MIN_MIXED_CAP_S, MixedWorkload
from pdserve.bench.word_tokenizer import WordTokenizer

pytestmark = pytest.mark.timeout(120)

# short: first token at 20 ms, then 9 more 30 ms apart (~290 ms each); long: 400 ms to the first
# token (a long prefill), then 7 more 10 ms apart.
SCRIPT = {
    "short": {"ttft_ms": 20, "itl_ms": [30] * 9},
    "long": {"ttft_ms": 400, "itl_ms": [10] * 7},
}


def _shorts(n: int) -> list[SampleRequest]:
    return [SampleRequest(f"case:short q{i}", 3, 10, label="short") for i in range(n)]


def _long(i: int) -> SampleRequest:
    return SampleRequest(f"case:long document {i}", 4, 8, label="long")


def _configs(url: str) -> tuple[BenchConfig, BenchConfig]:
    common: dict[str, Any] = dict(base_url=url, model="fake-model", disable_tqdm=True,
                                  ignore_eos=True, percentiles=(50.0, 99.0))  # fmt: skip
    short = BenchConfig(**common, max_concurrency=2, label="short mixed")
    long = BenchConfig(**common, request_rate=5.0, label="long mixed")
    return short, long


def test_long_client_runs_beside_the_short_run_and_stops_with_it(
    fake_server: Callable[[dict[str, Any]], FakeServer],
) -> None:
    server = fake_server(SCRIPT)
    short_cfg, long_cfg = _configs(server.base_url)
    longs = LongPrompts([_long(0), _long(1)], _long)  # the rest are built during the run
    short, long = asyncio.run(run_mixed(short_cfg, _shorts(8), long_cfg, longs, WordTokenizer()))

    assert short.metrics.completed == 8 and short.metrics.failed == 0  # no warm-up was sent
    # the short run takes 4 waves x ~290 ms: at 5/s the long client sends about 6 prompts
    assert 3 <= len(long.requests) <= 10
    assert long.metrics.completed == len(long.requests) and long.metrics.failed == 0
    assert longs.made_late == len(long.requests) - 2 + 1  # one more prepared for the next tick
    log = server.log()
    shorts = [r for r in log if r["case"] == "short"]
    longs_sent = [r for r in log if r["case"] == "long"]
    assert len(shorts) == 8 and len(longs_sent) == len(long.requests)
    short_end = max(r["chunk_times"][-1] for r in shorts)
    first_short = min(r["t_request"] for r in shorts)
    # both started together; no long prompt was sent after the short run ended
    assert abs(min(r["t_request"] for r in longs_sent) - first_short) < 0.1
    assert max(r["t_request"] for r in longs_sent) <= short_end + 0.05
    gaps = sorted(
        b["t_request"] - a["t_request"] for a, b in zip(longs_sent, longs_sent[1:], strict=False)
    )
    assert abs(gaps[len(gaps) // 2] - 0.2) < 0.05  # evenly spaced at 5/s
    # every long prompt was waited for: its first token 400 ms after it was sent
    assert long.metrics.stats["ttft"].mean >= 390
    assert long.config.request_rate == 5.0 and long.model == "fake-model"


def test_paced_client_needs_a_rate_and_a_model(
    fake_server: Callable[[dict[str, Any]], FakeServer],
) -> None:
    server = fake_server(SCRIPT)
    _, long_cfg = _configs(server.base_url)
    stop = asyncio.Event()
    prompts = LongPrompts([], _long)
    with pytest.raises(ValueError, match="finite request rate"):
        asyncio.run(run_paced_until(BenchConfig(base_url=server.base_url, model="m"), prompts,
                                    stop))  # fmt: skip
    with pytest.raises(ValueError, match="config.model"):
        asyncio.run(run_paced_until(BenchConfig(request_rate=1.0), prompts, stop))


def test_long_requests_still_running_after_the_drain_time_are_cut_off(
    fake_server: Callable[[dict[str, Any]], FakeServer],
) -> None:
    # long prompts take 3 s to their first token; the short run ends after ~0.3 s
    server = fake_server({**SCRIPT, "long": {"ttft_ms": 3000, "itl_ms": [10] * 7}})
    short_cfg, long_cfg = _configs(server.base_url)
    longs = LongPrompts([_long(i) for i in range(8)], _long)
    t0 = time.perf_counter()
    short, long = asyncio.run(
        run_mixed(short_cfg, _shorts(2), long_cfg, longs, WordTokenizer(), drain_s=0.5)
    )
    assert time.perf_counter() - t0 < 2.5  # did not wait the 3 s of the long requests
    assert short.metrics.completed == 2
    assert long.requests and long.metrics.completed == 0
    assert long.metrics.failed == len(long.requests)
    assert all(o.error.startswith(UNFINISHED) and "0.5 s after" in o.error for o in long.outputs)
    assert all(o.start_time > 0 for o in long.outputs)


def test_a_short_run_past_the_cap_fails_the_mixed_run_without_waiting_it_out(
    fake_server: Callable[[dict[str, Any]], FakeServer],
) -> None:
    """A server whose short requests starve (here: 3 s each) is cut off at the cap (0.6 s) with
    an error saying so; both clients stop."""
    server = fake_server({**SCRIPT, "short": {"ttft_ms": 3000, "itl_ms": [10] * 9}})
    short_cfg, long_cfg = _configs(server.base_url)
    longs = LongPrompts([_long(i) for i in range(8)], _long)
    t0 = time.perf_counter()
    with pytest.raises(BenchmarkError, match="cap of 0.6 s: the server fell behind"):
        asyncio.run(run_mixed(short_cfg, _shorts(4), long_cfg, longs, WordTokenizer(), max_s=0.6))
    assert time.perf_counter() - t0 < 2.5


def test_the_mixed_cap_scales_with_the_run_alone() -> None:
    w = MixedWorkload(mixed_cap_factor=10.0)
    assert w.mixed_cap_s(30.0) == 300.0
    assert w.mixed_cap_s(1.0) == MIN_MIXED_CAP_S
    with pytest.raises(ValueError, match="mixed_cap_factor must be > 0"):
        MixedWorkload(mixed_cap_factor=0)


def test_long_client_stops_after_max_long_prompts_and_waits_for_the_short_run(
    fake_server: Callable[[dict[str, Any]], FakeServer],
) -> None:
    server = fake_server(SCRIPT)
    short_cfg, long_cfg = _configs(server.base_url)
    longs = LongPrompts([_long(i) for i in range(2)], _long)
    t0 = time.perf_counter()
    short, long = asyncio.run(
        run_mixed(short_cfg, _shorts(8), long_cfg, longs, WordTokenizer(), max_long=2)
    )
    took = time.perf_counter() - t0
    # the short run (4 waves x ~290 ms) outlasts the two long prompts (sent 200 ms apart)
    assert short.metrics.completed == 8
    assert len(long.requests) == 2 and long.metrics.completed == 2
    assert longs.made_late == 0  # no prompt past the cap was built
    assert took >= short.metrics.duration_s
    assert [r["case"] for r in server.log()].count("long") == 2


def test_a_negative_long_prompt_count_is_refused() -> None:
    with pytest.raises(ValueError, match="long_num_prompts"):
        MixedWorkload(long_num_prompts=-1)
