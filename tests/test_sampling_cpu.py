"""The sampler's C kernel (pdserve/sampling_cpu.py): argmax and the two-level race read fp32 and
bf16 logits in place and draw what the torch path draws."""

from __future__ import annotations

import pytest
import torch

from pdserve import sampling
from pdserve.engine.batch import ScheduledSeq
from pdserve.sampling import RACE_BLOCK, Sampler
from pdserve.sampling_cpu import cpu_argmax, cpu_race, kernel_can_read, sampling_kernel_reason
from pdserve.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        sampling_kernel_reason() is not None, reason=f"no kernel: {sampling_kernel_reason()}"
    ),
]


def seq(i: int, **params: object) -> ScheduledSeq:
    return ScheduledSeq(
        request_id=f"r{i}",
        token_ids=[0],
        num_computed=0,
        block_table=[0],
        sample=True,
        sampling=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=[1, 2],
        output_token_ids=[3] * (i % 5),
    )


def race_by_definition(
    x: torch.Tensor, cols: int, temps: list[float], noise: torch.Tensor
) -> torch.Tensor:
    """The race of pdserve.sampling spelled out in torch (fp32, logits divided by temperature)."""
    rows, nb = x.shape[0], -(-cols // RACE_BLOCK)
    xf = x[:, :cols].float() / torch.tensor(temps).unsqueeze(1)
    xf = torch.nn.functional.pad(xf, (0, nb * RACE_BLOCK - cols), value=float("-inf"))
    xb = xf.view(rows, nb, RACE_BLOCK)
    block = (torch.logsumexp(xb, dim=-1) + noise[:, :nb]).argmax(dim=-1)
    inner = xb[torch.arange(rows), block]
    return block * RACE_BLOCK + (inner + noise[:, nb:]).argmax(dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1, 15, 1000, 1024, 2049, 49152])
def test_argmax_is_torch_argmax(dtype: torch.dtype, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    x = (torch.randn(5, cols + 7, generator=gen) * 4).to(dtype)  # 7 padding columns, ignored
    x[0, cols + 2] = 1e4
    x[1, : cols // 2] = float("-inf")
    x[2, :] = float("-inf")  # every entry -inf: index 0, as torch
    if cols > 3:
        x[3, 3] = float("inf")
        x[4, cols - 1] = float("nan")  # NaN counts as maximal
        x[4, cols - 2] = float("nan")
    got = cpu_argmax(x, cols)
    assert got is not None and torch.equal(got, x[:, :cols].argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [4, RACE_BLOCK, 2 * RACE_BLOCK + 37, 49152])
def test_race_is_the_race_by_definition(dtype: torch.dtype, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols + 1)
    rows, nb = 24, -(-cols // RACE_BLOCK)
    x = (torch.randn(rows, cols, generator=gen) * 3).to(dtype)
    x[1, : cols - 1] = float("-inf")  # one finite token
    x[2, : min(cols - 1, RACE_BLOCK)] = float("-inf")  # a whole first block truncated away
    u = torch.rand(rows, nb + RACE_BLOCK, generator=gen, dtype=torch.float64)
    noise = (-(-(-u).log1p()).log()).float()
    temps = [0.5 + 0.1 * i for i in range(rows)]
    got = cpu_race(x, cols, temps, noise, RACE_BLOCK)
    assert got is not None and torch.equal(got, race_by_definition(x, cols, temps, noise))
    assert got[1].item() == cols - 1


def test_race_rejects_a_misshapen_noise() -> None:
    x = torch.randn(2, 300)
    with pytest.raises(ValueError, match="noise"):
        cpu_race(x, 300, [1.0, 1.0], torch.zeros(2, 5), RACE_BLOCK)
    with pytest.raises(ValueError, match="temperatures"):
        cpu_race(x, 300, [1.0], torch.zeros(2, 2 + RACE_BLOCK), RACE_BLOCK)


def test_what_the_kernel_does_not_read_goes_to_torch() -> None:
    x = torch.randn(3, 40)
    assert kernel_can_read(x, 40) and kernel_can_read(x.bfloat16(), 40)
    assert not kernel_can_read(x.t(), 3)  # columns not adjacent
    assert not kernel_can_read(x.half(), 40) and not kernel_can_read(x.double(), 40)
    assert not kernel_can_read(x, 41)
    assert cpu_argmax(x.half(), 40) is None
    # the sampler takes such logits through its torch path, with the same result
    seqs = [seq(i, temperature=0.0) for i in range(3)]
    out = Sampler(40)(x.t().contiguous().t(), seqs)
    assert [t.token_id for t in out] == x.argmax(dim=-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_draws_the_same_with_and_without_the_kernel(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seeded rows, greedy rows and plain temperature rows (the kernel's cases), in one batch and
    apart: the same tokens as the torch path (PDSERVE_CPU_SAMPLING_KERNEL=0)."""
    vocab = 5000
    logits = (torch.randn(12, vocab + 16, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    params: list[dict[str, object]] = [
        {"temperature": 0.0},
        {"temperature": 0.7, "seed": 11},
        {"temperature": 1.0, "seed": 12},
        {"top_k": 1},
        {"temperature": 1.3, "seed": 13},
        {"temperature": 0.9, "seed": 14, "top_k": 0, "top_p": 1.0},
    ] * 2
    seqs = [seq(i, **p) for i, p in enumerate(params)]
    calls: list[int] = []
    race = sampling.cpu_race
    monkeypatch.setattr(sampling, "cpu_race", lambda *a: calls.append(1) or race(*a))
    with_kernel = [t.token_id for t in Sampler(vocab)(logits, seqs)]
    alone = [Sampler(vocab)(logits[i : i + 1], [s])[0].token_id for i, s in enumerate(seqs)]
    assert calls  # the kernel ran
    monkeypatch.setenv("PDSERVE_CPU_SAMPLING_KERNEL", "0")
    calls.clear()
    without = [t.token_id for t in Sampler(vocab)(logits, seqs)]
    assert not calls
    assert with_kernel == without == alone


def test_rows_that_need_processing_take_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    race = sampling.cpu_race
    monkeypatch.setattr(sampling, "cpu_race", lambda *a: calls.append(1) or race(*a))
    logits = torch.randn(1, 600)
    for params in (
        {"top_p": 0.9},
        {"top_k": 5},
        {"min_p": 0.1},
        {"repetition_penalty": 1.2},
        {"logprobs": True},
    ):
        Sampler(600)(logits, [seq(0, **params)])
    assert not calls
    Sampler(600)(logits, [seq(0)])
    assert calls == [1]
