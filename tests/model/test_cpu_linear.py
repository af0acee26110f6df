"""Pre-packed oneDNN linears: same outputs as the dense layers, tied lm_head, graceful fallback."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TINY, PagedForward

from pdserve.config import LoadConfig
from pdserve.model import cpu_linear
from pdserve.model.cpu_linear import (
    SKINNY_MAX_ROWS,
    SKINNY_PANEL,
    PackedLinear,
    can_pack,
    pack_linears,
    skinny_applies,
    skinny_linear,
    skinny_pack,
    skinny_reason,
    skinny_rows,
)
from pdserve.model.loader import load_model

pytestmark = pytest.mark.timeout(120)

needs_onednn = pytest.mark.skipif(
    not can_pack(torch.zeros(4, 4)), reason="torch built without MKL-DNN"
)


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64, 130])
def test_packed_linear_matches_dense(dtype: torch.dtype, rows: int) -> None:
    if not can_pack(torch.zeros(4, 4, dtype=dtype)):
        pytest.skip(f"oneDNN cannot pack {dtype} on this CPU")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 24, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype)
    x = torch.randn(rows, 24, generator=gen).to(dtype)
    layer = PackedLinear(w, b, batch_hint=16)
    y = layer(x)
    assert y.shape == (rows, 40) and y.dtype == dtype
    ref = F.linear(x.float(), w.float(), b.float())
    tol = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(y.float(), ref, atol=tol, rtol=tol)
    # any leading shape, non-contiguous input, no bias
    x3 = torch.randn(2, 3, 48, generator=gen).to(dtype)[..., ::2]
    ref3 = F.linear(x3.float(), w.float())
    torch.testing.assert_close(PackedLinear(w, None)(x3).float(), ref3, atol=tol, rtol=tol)


def test_can_pack_rejects_what_onednn_cannot_take() -> None:
    assert not can_pack(torch.zeros(4))  # not a matrix
    assert not can_pack(torch.zeros(4, 4, dtype=torch.int32))
    assert not can_pack(torch.zeros(4, 4, device="meta"))


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_pack_linears_keeps_the_model_output(tied: bool) -> None:
    cfg = replace(TINY, tie_word_embeddings=tied)
    load = LoadConfig(model="dummy", load_format="dummy", dtype="float32", seed=3)
    dense, packed = load_model(load, cfg), load_model(load, cfg)
    n = pack_linears(packed)
    # q|k|v, o, gate|up, down per layer, plus the lm_head (untied) or nothing (tied: installed)
    assert n == 4 * cfg.num_hidden_layers + (0 if tied else 1)
    assert isinstance(packed.lm_head, PackedLinear)
    assert not any(isinstance(m, torch.nn.Linear) for m in packed.modules())
    chunks, computed, tables = [[5, 9, 17, 3, 40], [7, 8]], [0, 0], [[0, 1], [2]]
    want = PagedForward(dense)(chunks, computed, tables)
    got = PagedForward(packed)(chunks, computed, tables)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the embedding itself stays a dense table
    assert torch.equal(packed.input_embeddings().weight, dense.input_embeddings().weight)


@needs_onednn
def test_panels_share_one_mapping_on_huge_pages() -> None:
    """pack_linears puts every skinny panel in one mapping, each at a 4 KiB boundary, with the
    packed values unchanged; a mapping of 2 MiB or more asks Linux for huge pages."""
    if skinny_reason() is not None:
        pytest.skip("no skinny kernel on this CPU: no panels to place")
    load = LoadConfig(model="dummy", load_format="dummy", dtype="float32", seed=3)
    model = load_model(load, TINY)
    weights = {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if hasattr(m, "weight") and isinstance(m, torch.nn.Linear)
    }
    pack_linears(model)
    mods = {n: m for n, m in model.named_modules() if isinstance(m, PackedLinear)}
    panels = [m.skinny_weight for m in mods.values()]
    assert panels and all(p is not None for p in panels)
    base = min(p.data_ptr() for p in panels)
    assert len({p.untyped_storage().data_ptr() for p in panels}) == 1
    assert all((p.data_ptr() - base) % 4096 == 0 for p in panels)
    for name, w in weights.items():
        assert torch.equal(mods[name].skinny_weight, skinny_pack(w))
    big = torch.nn.Sequential(PackedLinear(torch.randn(1024, 1024), None))
    before = big[0].skinny_weight.clone()
    huge = cpu_linear.panels_on_huge_pages(big)
    assert huge == sys.platform.startswith("linux")
    assert torch.equal(big[0].skinny_weight, before)


# ------------------------------------------------------- the skinny (few-row) fp32 and bf16 kernels

has_skinny = skinny_reason() is None
has_skinny_bf16 = skinny_reason(torch.bfloat16) is None


@needs_onednn
def test_skinny_kernel_is_used_exactly_where_it_applies() -> None:
    w = torch.randn(40, 24)
    auto = PackedLinear(w, None)
    assert PackedLinear(w, None, skinny=False).skinny_weight is None
    assert not skinny_applies(w.half()) and not skinny_applies(w.bfloat16()[:, :23])  # odd K
    if can_pack(w.bfloat16()):  # bf16: panels where the CPU has AVX512_BF16
        bf16 = PackedLinear(w.bfloat16(), None)
        assert (bf16.skinny_weight is not None) == has_skinny_bf16 == skinny_applies(w.bfloat16())
        assert PackedLinear(w.bfloat16(), None, skinny=False).skinny_weight is None
        if not has_skinny_bf16:
            with pytest.raises(RuntimeError, match="AVX512_BF16"):
                PackedLinear(w.bfloat16(), None, skinny=True)
    if has_skinny:
        assert auto.skinny_weight is not None and "skinny" in repr(auto)
        assert skinny_applies(w)
    else:  # no AVX-512F (or no C compiler) here: oneDNN only, and asking for it is an error
        assert auto.skinny_weight is None and not skinny_applies(w)
        with pytest.raises(RuntimeError, match="skinny kernel unavailable"):
            PackedLinear(w, None, skinny=True)
        with pytest.raises(RuntimeError, match="skinny kernel unavailable"):
            skinny_linear(torch.randn(2, 24), skinny_pack(w), 40, None)


def count_skinny_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row count of every call the skinny kernel runs from now on (appended as it runs)."""
    calls: list[int] = []
    real = cpu_linear._skinny_run

    def spy(fn: Any, x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(fn, x, *args)

    monkeypatch.setattr(cpu_linear, "_skinny_run", spy)
    return calls


@pytest.mark.parametrize("amx", [True, False])
def test_bf16_calls_past_four_rows_go_to_onednn_on_an_amx_cpu(
    amx: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # on AMX oneDNN's tile GEMM beats the VDPBF16PS kernel past 4 rows, the kernel's own AMX
    # path beats oneDNN up to 16 (docs/benchmarks.md)
    monkeypatch.setattr(cpu_linear, "has_amx_bf16", lambda: amx)
    cpu_linear.skinny_rows.cache_clear()
    try:
        tiles = amx and cpu_linear.skinny_amx()  # the kernel's own AMX path (16 rows)
        want = (1, 16) if tiles else (1, 4) if amx else (1, SKINNY_MAX_ROWS)
        assert skinny_rows(torch.bfloat16) == want
        assert skinny_rows(torch.float32) == (1, SKINNY_MAX_ROWS)
        if not (has_skinny_bf16 and can_pack(torch.zeros(4, 4, dtype=torch.bfloat16))):
            return
        calls = count_skinny_calls(monkeypatch)
        w = torch.randn(40, 24).bfloat16()
        layer = PackedLinear(w, None)
        for rows in (1, 4, 5, 16):
            x = torch.randn(rows, 24).bfloat16()
            torch.testing.assert_close(layer(x), x @ w.T, atol=2e-2, rtol=2e-2)
        assert calls == ([1, 4] if amx and not tiles else [1, 4, 5, 16])
    finally:
        cpu_linear.skinny_rows.cache_clear()


def test_skinny_pack_layout() -> None:
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = skinny_pack(w)
    assert panels.shape == (2, 3, SKINNY_PANEL) and panels.is_contiguous()
    for n in range(20):
        assert torch.equal(panels[n // SKINNY_PANEL, :, n % SKINNY_PANEL], w[n])
    assert not panels[1, :, 20 - SKINNY_PANEL :].any()  # zero padding past N
    # bf16: pairs of consecutive k per column, [P, K / 2, 16, 2]
    wb = torch.arange(20 * 6, dtype=torch.float32).view(20, 6).bfloat16()
    pb = skinny_pack(wb)
    assert pb.shape == (2, 3, SKINNY_PANEL, 2) and pb.is_contiguous()
    for n in range(20):
        assert torch.equal(pb[n // SKINNY_PANEL, :, n % SKINNY_PANEL, :].reshape(6), wb[n])
    assert not pb[1, :, 20 - SKINNY_PANEL :].any()
    with pytest.raises(ValueError, match="even K"):
        skinny_pack(wb[:, :5])
    with pytest.raises(ValueError, match="float16"):
        skinny_pack(w.half())


@pytest.mark.skipif(not has_skinny, reason=f"skinny kernel unavailable: {skinny_reason()}")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 45])
@pytest.mark.parametrize(("n", "k"), [(40, 24), (16, 7), (3, 130)])
def test_skinny_linear_matches_dense(rows: int, n: int, k: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bias in (b, None):
            y = skinny_linear(x, skinny_pack(w), n, bias)
            assert y.shape == (rows, n) and y.dtype == torch.float32
            torch.testing.assert_close(y, F.linear(x, w, bias), atol=1e-5, rtol=1e-5)
        # any leading shape, a non-contiguous input; through the layer, as the model calls it
        x3 = torch.randn(1, rows, 2 * k, generator=gen)[..., ::2]
        layer = PackedLinear(w, b)
        assert layer.skinny_weight is not None
        torch.testing.assert_close(layer(x3), F.linear(x3, w, b), atol=1e-5, rtol=1e-5)
        empty = skinny_linear(torch.zeros(0, k), skinny_pack(w), n, None)
        assert empty.shape == (0, n)
    finally:
        torch.set_num_threads(before)


def _within_one_bf16_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: Any) -> None:
    """y (bf16) is the exact product rounded once to bf16: within half a bf16 step (2^-9
    relative) of the fp32 sum, plus the fp32 sum's own rounding (~1e-6 of the sum of |terms|)."""
    xf, wf = x.float(), w.float()
    exact = F.linear(xf, wf, None if b is None else b.float())
    slack = exact.abs() * 2.0**-8 + 1e-5 * (xf.abs() @ wf.abs().T + 1e-30)
    assert y.dtype == torch.bfloat16 and bool(((y.float() - exact).abs() <= slack).all())


@pytest.mark.skipif(
    not has_skinny_bf16, reason=f"skinny kernel unavailable: {skinny_reason(torch.bfloat16)}"
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 45])
@pytest.mark.parametrize(("n", "k"), [(40, 24), (16, 8), (3, 130), (40, 64), (33, 96)])
def test_skinny_bf16_linear_matches_dense(rows: int, n: int, k: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    w, b = torch.randn(n, k, generator=gen).bfloat16(), torch.randn(n, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for bias in (b, None):
            y = skinny_linear(x, skinny_pack(w), n, bias)
            assert y.shape == (rows, n)
            _within_one_bf16_rounding(y, x, w, bias)
            # against oneDNN's bf16 (also fp32 sums rounded once): the same but for the order of
            # the sum, so at most one bf16 step apart
            torch.testing.assert_close(y, F.linear(x, w, bias), atol=2e-2, rtol=2**-7)
        x3 = torch.randn(1, rows, 2 * k, generator=gen).bfloat16()[..., ::2]
        layer = PackedLinear(w, b)
        assert layer.skinny_weight is not None
        _within_one_bf16_rounding(layer(x3), x3, w, b)
        assert skinny_linear(torch.zeros(0, k).bfloat16(), skinny_pack(w), n, None).shape == (0, n)
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not has_skinny, reason=f"skinny kernel unavailable: {skinny_reason()}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_every_row_count(dtype: torch.dtype) -> None:
    """The kernel has one compiled block per row count 1 .. 16: each, and 16 + each, is right."""
    if dtype == torch.bfloat16 and not has_skinny_bf16:
        pytest.skip(f"skinny kernel unavailable: {skinny_reason(torch.bfloat16)}")
    gen = torch.Generator().manual_seed(7)
    w, b = torch.randn(35, 64, generator=gen).to(dtype), torch.randn(35, generator=gen).to(dtype)
    panels = skinny_pack(w)
    for rows in range(1, 34):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        y = skinny_linear(x, panels, 35, b)
        if dtype == torch.float32:
            torch.testing.assert_close(y, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
        else:
            _within_one_bf16_rounding(y, x, w, b)


@pytest.mark.skipif(not has_skinny, reason=f"skinny kernel unavailable: {skinny_reason()}")
def test_skinny_fp32_rows_together_equal_each_row_alone() -> None:
    """Every output is one chain of multiply-adds in k order whatever the row count and however
    the kernel blocks the rows and cuts k (AVX2: 128-step chunks for 7 to 32 rows), so a batch's
    rows are bit-equal to the same rows run one at a time."""
    gen = torch.Generator().manual_seed(11)
    w, b = torch.randn(35, 300, generator=gen), torch.randn(35, generator=gen)
    panels = skinny_pack(w)
    x = torch.randn(40, 300, generator=gen)
    alone = torch.cat([skinny_linear(x[i : i + 1], panels, 35, b) for i in range(40)])
    for rows in (*range(2, 34), 40):
        for bias in (b, None):
            want = alone[:rows] if bias is not None else None
            y = skinny_linear(x[:rows], panels, 35, bias)
            if want is None:
                want = torch.cat(
                    [skinny_linear(x[i : i + 1], panels, 35, None) for i in range(rows)]
                )
            assert torch.equal(y.view(torch.int32), want.view(torch.int32)), (rows, bias is None)


@pytest.mark.skipif(not has_skinny, reason=f"skinny kernel unavailable: {skinny_reason()}")
def test_skinny_linear_rejects_what_does_not_fit() -> None:
    w, x = torch.randn(40, 24), torch.randn(3, 24)
    panels = skinny_pack(w)
    with pytest.raises(ValueError, match="panels"):
        skinny_linear(torch.randn(3, 25), panels, 40, None)  # K mismatch
    with pytest.raises(ValueError, match="panels"):
        skinny_linear(x, panels, 49, None)  # more columns than the panels hold
    with pytest.raises(ValueError, match="panels"):
        skinny_linear(x.bfloat16(), panels, 40, None)
    with pytest.raises(ValueError, match="bias"):
        skinny_linear(x, panels, 40, torch.randn(39))
    with pytest.raises(ValueError, match="CPU"):
        skinny_linear(torch.empty(3, 24, device="meta"), panels, 40, None)
    if has_skinny_bf16:  # bf16 panels want bf16 x and bias, and K to match
        pb = skinny_pack(w.bfloat16())
        with pytest.raises(ValueError, match="panels"):
            skinny_linear(x, pb, 40, None)
        with pytest.raises(ValueError, match="panels"):
            skinny_linear(torch.randn(3, 26).bfloat16(), pb, 40, None)
        with pytest.raises(ValueError, match="bias"):
            skinny_linear(x.bfloat16(), pb, 40, torch.randn(40))
    # the layer never hands the kernel an input of the wrong width (oneDNN refuses it instead)
    with pytest.raises(RuntimeError):
        PackedLinear(w, None)(torch.randn(3, 25))
    # past SKINNY_MAX_ROWS (oneDNN, or the kernel where skinny_runs_large): the same result
    big = torch.randn(SKINNY_MAX_ROWS + 1, 24)
    torch.testing.assert_close(PackedLinear(w, None)(big), big @ w.T, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not has_skinny, reason=f"skinny kernel unavailable: {skinny_reason()}")
@pytest.mark.parametrize("avx512", [True, False])
def test_fp32_calls_past_the_skinny_rows_keep_the_kernel_only_without_avx512(
    avx512: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # without AVX-512F the kernel's AVX2 blocks beat oneDNN's fp32 GEMM at every row count
    # measured (docs/benchmarks.md); with it oneDNN wins past SKINNY_MAX_ROWS
    flags = cpu_linear.cpu_flags() - {"avx512f"} | ({"avx512f"} if avx512 else set())
    monkeypatch.setattr(cpu_linear, "cpu_flags", lambda: flags)
    # a process sharing its prefills' matmuls sends large calls to the helper's path first
    monkeypatch.setattr(cpu_linear._sharing, "on", False)
    assert cpu_linear.skinny_runs_large(torch.float32) is not avx512
    assert not cpu_linear.skinny_runs_large(torch.bfloat16)
    calls = count_skinny_calls(monkeypatch)
    w = torch.randn(40, 24)
    layer = PackedLinear(w, None, skinny=True)
    for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(layer(x), x @ w.T, atol=1e-5, rtol=1e-5)
    big = [] if avx512 else [SKINNY_MAX_ROWS + 1, 300]
    assert calls == [1, SKINNY_MAX_ROWS, *big]


@needs_onednn
def test_a_prefill_only_runner_holds_no_skinny_copy() -> None:
    from pdserve.config import CacheConfig, EngineConfig
    from pdserve.engine.runner import ModelRunner

    load = LoadConfig(model="dummy", load_format="dummy", dtype="float32", seed=3)
    config = EngineConfig(load=load, cache=CacheConfig(num_blocks=8))
    prefill = ModelRunner(config, TINY, skinny_linears=False)
    layers = [m for m in prefill.model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.skinny_weight is None for m in layers)
    decode = ModelRunner(config, TINY)
    layers = [m for m in decode.model.modules() if isinstance(m, PackedLinear)]
    assert all((m.skinny_weight is not None) == has_skinny for m in layers)


def test_the_skinny_kernel_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_SKINNY_GEMM", "0")
    w = torch.randn(40, 24)
    assert "PDSERVE_CPU_SKINNY_GEMM" in (skinny_reason() or "") and not skinny_applies(w)
    if can_pack(w):
        assert PackedLinear(w, None).skinny_weight is None


@pytest.mark.skipif(
    not has_skinny_bf16, reason=f"skinny kernel unavailable: {skinny_reason(torch.bfloat16)}"
)
def test_skinny_bf16_on_amx_tiles_matches_the_vector_blocks() -> None:
    """Where the build has AMX, 2 to 16 rows with K a multiple of 32 run on tiles; both paths
    stay within one bf16 rounding of the exact product. Elsewhere the switch reports it off."""
    from pdserve.attention.cpu_build import load_library
    from pdserve.cpu import has_amx_bf16

    lib = load_library(cpu_linear.SKINNY_SOURCE).lib
    assert lib is not None
    gen = torch.Generator().manual_seed(11)
    w, b = torch.randn(70, 576, generator=gen).bfloat16(), torch.randn(70, generator=gen).bfloat16()
    panels = skinny_pack(w)
    try:
        assert lib.pd_skinny_set_amx(0) == 0
        for rows in (2, 7, 16):
            x = torch.randn(rows, 576, generator=gen).bfloat16()
            vec = skinny_linear(x, panels, 70, b)
            on = bool(lib.pd_skinny_set_amx(1))
            assert on == (has_amx_bf16() and "-march=native" in load_library(
                cpu_linear.SKINNY_SOURCE).flags)  # fmt: skip
            tiles = skinny_linear(x, panels, 70, b)
            lib.pd_skinny_set_amx(0)
            _within_one_bf16_rounding(vec, x, w, b)
            _within_one_bf16_rounding(tiles, x, w, b)
    finally:
        lib.pd_skinny_set_amx(1)
