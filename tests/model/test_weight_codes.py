"""fp32 weights held as GGUF-style integer codes in the skinny kernel's panels: every weight
rebuilt bit for bit, so results equal the fp32 panels' exactly; anything else keeps fp32 panels."""

from __future__ import annotations

import gguf
import pytest
import torch
from tiny_models import gguf_values

from pdserve.model import cpu_linear
from pdserve.model.cpu_linear import (
    CODE_GROUP,
    SK_F32,
    SK_Q4,
    SK_Q8,
    PackedLinear,
    panels_format,
    skinny_linear,
    skinny_pack,
    skinny_pack_codes,
)

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        not cpu_linear._codes_built(),
        reason="the skinny kernel's weight codes need AVX-512F or AVX2 with FMA",
    ),
]

Q = gguf.GGMLQuantizationType


def gguf_weight(n: int, k: int, qtype: Q, seed: int) -> torch.Tensor:
    """An fp32 [n, k] weight as pdserve's GGUF loader produces it: random values quantised to
    ``qtype`` and dequantised by gguf-py."""
    x = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return gguf_values(x, qtype.name)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize(
    ("qtype", "fmt"), [(Q.Q4_1, SK_Q4), (Q.Q8_0, SK_Q8), (Q.Q4_0, SK_Q8), (Q.Q5_0, SK_Q8)]
)
@pytest.mark.parametrize(("n", "k"), [(40, 64), (16, 32), (3, 96), (50, 160), (20, 288)])
def test_gguf_weights_get_codes_and_the_fp32_panels_results(
    qtype: Q, fmt: int, n: int, k: int
) -> None:
    w = gguf_weight(n, k, qtype, seed=n * k)
    coded = skinny_pack_codes(w)
    assert coded is not None
    panels, got = coded
    assert got == fmt == panels_format(panels) and panels.dtype == torch.uint8
    groups_bytes = {SK_Q4: 384, SK_Q8: 576}[fmt]
    assert panels.shape == (-(-n // 16), k // CODE_GROUP, groups_bytes)
    gen = torch.Generator().manual_seed(n + k)
    bias = torch.randn(n, generator=gen)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 7, 15, 16, 17, 33):
                x = torch.randn(rows, k, generator=gen)
                for b in (None, bias):
                    want = skinny_linear(x, skinny_pack(w), n, b)
                    assert bits_equal(skinny_linear(x, panels, n, b), want), (rows, threads)
    finally:
        torch.set_num_threads(before)


def test_the_codes_layout() -> None:
    """Panel p, group g: 16 fp32 scales, 16 fp32 offsets (Q4), then byte j of pair s = column
    16p + j's codes for k = 32g + 2s (low nibble) and 32g + 2s + 1 (high nibble)."""
    n, k = 20, 64
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (n, k), generator=gen)
    q[:, ::CODE_GROUP] = 0  # each group's minimum codes 0 and its maximum 15 (as in Q4_1)
    q[:, 1::CODE_GROUP] = 15
    d = (torch.rand(n, k // CODE_GROUP, generator=gen) + 0.01).half().float()
    m = -torch.rand(n, k // CODE_GROUP, generator=gen).half().float()
    w = q.float() * d.repeat_interleave(CODE_GROUP, 1) + m.repeat_interleave(CODE_GROUP, 1)
    coded = skinny_pack_codes(w)
    assert coded is not None and coded[1] == SK_Q4
    panels = coded[0]
    for p, g, j in [(0, 0, 0), (0, 1, 5), (1, 1, 3), (1, 0, 0)]:
        row = 16 * p + j
        grp = panels[p, g]
        assert grp[:64].view(torch.float32)[j] == d[row, g]
        assert grp[64:128].view(torch.float32)[j] == m[row, g]
        for s in (0, 7, 15):
            byte = int(grp[128 + 16 * s + j])
            assert byte & 15 == q[row, 32 * g + 2 * s] and byte >> 4 == q[row, 32 * g + 2 * s + 1]
    # the padding rows (20 -> 32) code zero
    assert not panels[1, :, :64].view(torch.float32)[:, 4:].any()


def test_weights_without_an_exact_coding_keep_fp32_panels() -> None:
    w = gguf_weight(32, 64, Q.Q4_1, seed=1)
    assert skinny_pack_codes(torch.randn(32, 64)) is None
    nudged = w.clone()
    nudged[5, 40] = torch.nextafter(nudged[5, 40], torch.tensor(1.0))
    assert skinny_pack_codes(nudged) is None  # one weight off by one ulp
    assert skinny_pack_codes(gguf_weight(32, 64, Q.Q5_1, seed=2)) is None  # 5-bit codes
    assert skinny_pack_codes(w[:, :48].contiguous()) is None  # K not a multiple of 32
    assert skinny_pack_codes(w.bfloat16()) is None
    bad = w.clone()
    bad[0, 0] = float("nan")
    assert skinny_pack_codes(bad) is None
    layer = PackedLinear(torch.randn(32, 64), None)
    assert layer.skinny_weight is not None and panels_format(layer.skinny_weight) == SK_F32


def test_packed_linear_holds_codes_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    w = gguf_weight(48, 64, Q.Q4_1, seed=4)
    layer = PackedLinear(w, None)
    assert layer.skinny_weight is not None and panels_format(layer.skinny_weight) == SK_Q4
    assert "4-bit codes" in repr(layer)
    x = torch.randn(1, 3, 64)
    assert bits_equal(layer(x), skinny_linear(x, skinny_pack(w), 48, None))
    monkeypatch.setenv("PDSERVE_CPU_WEIGHT_CODES", "0")
    off = PackedLinear(w, None)
    assert off.skinny_weight is not None and panels_format(off.skinny_weight) == SK_F32


def test_skinny_linear_rejects_uint8_panels_that_are_not_codes() -> None:
    with pytest.raises(ValueError, match="not coded panels"):
        skinny_linear(torch.randn(2, 64), torch.zeros(2, 2, 100, dtype=torch.uint8), 32, None)
    panels, _ = skinny_pack_codes(gguf_weight(32, 64, Q.Q8_0, seed=5)) or (None, None)
    assert panels is not None
    with pytest.raises(ValueError, match="must fit"):
        skinny_linear(torch.randn(2, 96), panels, 32, None)  # K of x differs
    with pytest.raises(ValueError, match="must fit"):
        skinny_linear(torch.randn(2, 64).bfloat16(), panels, 32, None)
