"""Pre-packed oneDNN linears: same outputs as the dense layers, tied lm_head, graceful fallback."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TINY, PagedForward

from pdserve.config import LoadConfig
from pdserve.model.cpu_linear import PackedLinear, can_pack, pack_linears
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
