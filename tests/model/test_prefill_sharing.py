"""A prefill's matmuls shared with the helper thread (pd_shared_linear, share_prefill_linears)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.actor import HELPER_THREAD_NAME, restore_priority
from pdserve.model import cpu_decode, cpu_linear
from pdserve.model.cpu_linear import (
    DEFAULT_PREFILL_HELPER,
    PackedLinear,
    can_pack,
    prefill_helper_setting,
    share_prefill_linears,
    skinny_reason,
)

pytestmark = pytest.mark.timeout(120)

has_shared = (
    can_pack(torch.zeros(4, 4))
    and skinny_reason() is None
    and cpu_linear._shared_entry() is not None
    and len(os.sched_getaffinity(0)) > 1
)
needs_shared = pytest.mark.skipif(
    not has_shared, reason="needs oneDNN, the fp32 skinny kernel, a C compiler and 2 CPUs"
)


@pytest.fixture
def sharing() -> Iterator[None]:
    """Sharing on (helper at niceness 5) for the test, off after it."""
    assert share_prefill_linears(5)
    try:
        yield
    finally:
        share_prefill_linears(None)
        cpu_decode.set_helper_delay(0)


def _until_helper_counted(run: Callable[[], None], counter: int) -> bool:
    """Call ``run`` until the helper's counter ``counter`` (of :func:`cpu_decode.helper_stats`)
    grows, for at most 60 s (the helper runs only when the OS gives it a CPU)."""
    start = cpu_decode.helper_stats()[counter]
    deadline = time.monotonic() + 60
    while True:
        run()
        if cpu_decode.helper_stats()[counter] > start or time.monotonic() > deadline:
            return cpu_decode.helper_stats()[counter] > start


@needs_shared
@pytest.mark.parametrize("rows", [33, 95, 96, 97, 300])
@pytest.mark.parametrize(("n", "k", "bias"), [(40, 24, True), (960, 576, False), (3, 130, True)])
def test_shared_matmul_matches_dense(sharing: None, rows: int, n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows + n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    layer = PackedLinear(w, b, skinny=True)
    x = torch.randn(rows, 2 * k, generator=gen)[:, ::2]  # a row stride of its own
    ref = F.linear(x.double(), w.double(), None if b is None else b.double()).float()
    y = layer(x)
    assert y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@needs_shared
def test_the_helper_computes_chunks_of_a_large_matmul(sharing: None) -> None:
    """300 x 576 @ 576 x 960: 4 row blocks by 15 panel groups, which the helper shares."""
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(960, 576, generator=gen), torch.randn(960, generator=gen)
    layer = PackedLinear(w, b, skinny=True)
    x = torch.randn(300, 576, generator=gen)
    ref = F.linear(x.double(), w.double(), b.double()).float()
    got: list[torch.Tensor] = []
    assert _until_helper_counted(lambda: got.append(layer(x)), 0)
    for y in got:
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@needs_shared
def test_late_helper_chunks_are_taken_back(sharing: None) -> None:
    """A helper that naps after each claim (as if preempted) has its chunks recomputed by the
    caller; the results stay exact."""
    w = torch.randn(1024, 256)
    layer = PackedLinear(w, None, skinny=True)
    x = torch.randn(200, 256)
    ref = F.linear(x.double(), w.double()).float()
    cpu_decode.set_helper_delay(0.003)
    outs: list[torch.Tensor] = []
    assert _until_helper_counted(lambda: outs.append(layer(x)), 1)
    for y in outs:
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)


@needs_shared
def test_only_calls_past_the_skinny_rows_share(sharing: None) -> None:
    """Decode-sized calls keep the skinny kernel; a layer without panels keeps oneDNN."""
    w = torch.randn(64, 32)
    x = torch.randn(cpu_linear.SKINNY_MAX_ROWS, 32)
    before = cpu_decode.helper_stats()
    for _ in range(20):
        PackedLinear(w, None, skinny=True)(x)
        PackedLinear(w, None, skinny=False)(torch.randn(300, 32))
    assert cpu_decode.helper_stats() == before


def test_prefill_helper_setting_reads_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_HELPER", "bogus")
    with pytest.raises(ValueError, match="PDSERVE_CPU_PREFILL_HELPER"):
        prefill_helper_setting(torch.float32)
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_HELPER", "0")
    assert prefill_helper_setting(torch.float32) is None
    if not has_shared:
        return
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_HELPER", "idle")
    assert prefill_helper_setting(torch.float32) == -1
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_HELPER", "7")
    assert prefill_helper_setting(torch.float32) == 7
    monkeypatch.setenv("PDSERVE_CPU_PREFILL_HELPER", "auto")
    monkeypatch.setattr(cpu_linear, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert prefill_helper_setting(torch.float32) == DEFAULT_PREFILL_HELPER
    monkeypatch.setattr(cpu_linear, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    assert prefill_helper_setting(torch.float32) is None
    assert prefill_helper_setting(torch.float16) is None


@needs_shared
def test_a_sharing_prefill_engine_holds_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiny_models import TINY

    from pdserve.config import CacheConfig, EngineConfig, LoadConfig
    from prefill_worker.engine import PrefillEngine

    load = LoadConfig(model="dummy", load_format="dummy", dtype="float32", seed=3)
    config = EngineConfig(load=load, cache=CacheConfig(num_blocks=8))
    for setting, panels in (("0", False), ("5", True)):
        monkeypatch.setenv("PDSERVE_CPU_PREFILL_HELPER", setting)
        engine = PrefillEngine.build(config, TINY)
        try:
            layers = [m for m in engine.runner.model.modules() if isinstance(m, PackedLinear)]
            assert layers and all((m.skinny_weight is not None) == panels for m in layers)
            assert cpu_linear._sharing.on == panels
        finally:
            engine.shutdown()
            share_prefill_linears(None)


def _comm(tid: str) -> str:
    """Thread ``tid``'s name; '' for one that ended after the listing."""
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


@needs_shared
def test_restore_priority_leaves_the_helper_alone(sharing: None) -> None:
    layer = PackedLinear(torch.randn(64, 32), None, skinny=True)
    layer(torch.randn(100, 32))  # starts the helper
    tids = [int(t) for t in os.listdir("/proc/self/task") if _comm(t) == HELPER_THREAD_NAME]
    assert len(tids) == 1
    deadline = time.monotonic() + 30  # the helper applies its niceness on its next turn
    while os.getpriority(os.PRIO_PROCESS, tids[0]) != 5 and time.monotonic() < deadline:
        layer(torch.randn(100, 32))
    assert os.getpriority(os.PRIO_PROCESS, tids[0]) == 5
    restore_priority()
    assert os.getpriority(os.PRIO_PROCESS, tids[0]) == 5
