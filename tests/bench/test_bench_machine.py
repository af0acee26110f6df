"""Machine rates (pdserve.bench.machine): every rate measured, in the right places, JSON-ready.
No timing assertion: only that rates are finite and positive and the record is complete."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest
import torch

from pdserve.bench.machine import (
    RECORDED_FLAGS,
    _best_seconds,
    cpu_description,
    linear_gflops,
    measure_machine,
    model_linear_shapes,
    torch_threads,
)
from pdserve.config import ModelConfig

pytestmark = pytest.mark.timeout(120)

SMOLLM2_LIKE = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip
TINY = ModelConfig(
    architecture="LlamaForCausalLM", vocab_size=64, hidden_size=16, intermediate_size=24,
    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    max_position_embeddings=64,
)  # fmt: skip


def test_model_linear_shapes() -> None:
    assert model_linear_shapes(SMOLLM2_LIKE) == [
        ("qkv_proj", 576, 576 + 2 * 192),
        ("o_proj", 576, 576),
        ("gate_up_proj", 576, 3072),
        ("down_proj", 1536, 576),
        ("lm_head", 576, 49152),
    ]


def test_measure_machine_records_every_rate() -> None:
    rates = measure_machine(
        "float32", TINY, matmul_n=64, token_counts=(4, 32), reps=1, copy_bytes=2**20
    )
    threads = torch.get_num_threads()
    assert rates.threads == threads and set(rates.matmul_gflops) == {threads, 1}
    assert set(rates.copy_gbs) == {threads, 1}
    assert len(rates.linears) == 5 * 2 * len({threads, 1})  # shapes x token counts x threads
    every = [*rates.matmul_gflops.values(), *rates.copy_gbs.values()]
    every += [r.gflops for r in rates.linears]
    assert all(math.isfinite(v) and v > 0 for v in every)
    assert rates.peak_gflops == max([*rates.matmul_gflops.values(),
                                     *(r.gflops for r in rates.linears)])  # fmt: skip
    assert rates.peak_copy_gbs == max(rates.copy_gbs.values())
    assert torch.get_num_threads() == threads  # restored after the one-thread pass
    doc = json.loads(json.dumps(rates.to_dict()))
    assert doc["dtype"] == "float32" and doc["peak_gflops"] == rates.peak_gflops
    assert set(doc["cpu"]["flags"]) == set(RECORDED_FLAGS)
    assert doc["matmul_gflops"].keys() == {str(threads), "1"}


def test_cpu_description_and_threads() -> None:
    cpu = cpu_description()
    assert cpu["model_name"] and cpu["logical_cpus"] >= 1
    assert all(isinstance(v, bool) for v in cpu["flags"].values())
    before = torch.get_num_threads()
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_best_seconds_repeats_for_the_minimum_time() -> None:
    calls = []
    best = _best_seconds(lambda: calls.append(1), reps=3, min_total_s=0.0)
    assert len(calls) == 1 + 3 and best >= 0  # warm-up + reps
    calls.clear()
    _best_seconds(lambda: calls.append(1), reps=2, min_total_s=10.0)
    assert len(calls) == 1 + 40  # capped at 20 x reps when the minimum time is not reached


def test_linear_rate_is_the_better_of_f_linear_and_the_packed_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pdserve.bench import machine
    from pdserve.model.cpu_linear import can_pack

    timed: list[object] = []
    seconds = iter([2.0, 0.5])  # F.linear first, then the packed oneDNN weight

    def fake_best(fn: Callable[[], object], reps: int) -> float:
        timed.append(fn())
        return next(seconds)

    monkeypatch.setattr(machine, "_best_seconds", fake_best)
    rate = linear_gflops(torch.float32, 8, 64, 32, reps=1)
    flops = 2 * 8 * 64 * 32
    if can_pack(torch.zeros(32, 64)):
        assert len(timed) == 2 and rate == pytest.approx(flops / 0.5 / 1e9)
        assert all(isinstance(t, torch.Tensor) and t.shape == (8, 32) for t in timed)
    else:  # no oneDNN in this build: F.linear alone
        assert len(timed) == 1 and rate == pytest.approx(flops / 2.0 / 1e9)
