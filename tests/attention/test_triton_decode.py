"""Paged decode kernel (split-K) against torch_ref, under the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.triton_kernels.decode import decode_splits, paged_decode_attention

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _decode(case, out: torch.Tensor, seq_ids=None, num_splits=None) -> None:  # noqa: ANN001
    tm = case.tmeta
    paged_decode_attention(
        case.q, case.k_cache, case.v_cache, tm.block_tables, tm.seq_lens, tm.query_start_loc_i32,
        out, case.scale, tm.max_decode_seq_len, seq_ids=seq_ids, num_splits=num_splits,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 7])
def test_decode_matches_torch_ref(paged_case, group: int, dtype: torch.dtype) -> None:
    # contexts that are (16, 64) and are not (1, 5, 37, 130) multiples of the block size 8
    seqs = [(ctx - 1, 1) for ctx in (5, 16, 37, 1, 64, 130)]
    case = paged_case(seqs, 2 * group, 2, 32, 8, dtype, seed=group)
    assert case.tmeta.decode_ids is None and case.tmeta.num_decodes == len(seqs)
    out = case.poisoned()
    _decode(case, out)
    assert case.err(out) < case.tolerance


@pytest.mark.parametrize(
    "dtype,group,head_dim",
    [(torch.float32, 7, 32), (torch.bfloat16, 3, 24), (torch.float16, 1, 64)],
    ids=str,
)
def test_split_k_decode_matches_torch_ref(
    paged_case, dtype: torch.dtype, group: int, head_dim: int
) -> None:
    """Four 128-token splits of the longest context; shorter contexts leave splits empty."""
    seqs = [(ctx - 1, 1) for ctx in (500, 129, 64, 7)]
    case = paged_case(seqs, 2 * group, 2, head_dim, 16, dtype, seed=head_dim)
    out = case.poisoned()
    _decode(case, out, num_splits=4)
    assert case.err(out) < case.tolerance
    one = case.poisoned()
    _decode(case, one, num_splits=1)  # no merge kernel: written directly
    assert case.err(one) < case.tolerance


def test_decode_writes_only_its_sequences(paged_case) -> None:
    """In a mixed batch the decode kernel writes the decode rows and nothing else."""
    seqs = [(4, 1), (0, 6), (9, 1), (3, 5)]
    case = paged_case(seqs, 6, 2, 16, 4, torch.float32)
    tm = case.tmeta
    assert tm.decode_ids is not None and tm.decode_ids.tolist() == [0, 2]
    out = case.poisoned()
    _decode(case, out, seq_ids=tm.decode_ids, num_splits=2)
    rows = torch.tensor([0, 7])
    assert case.err(out, rows) < case.tolerance
    others = torch.ones(out.shape[0], dtype=torch.bool)
    others[rows] = False
    assert out[others].isnan().all()


def test_decode_splits_fill_the_gpu() -> None:
    """Split only when sequences x KV heads leave SMs idle; never below 256 tokens a split."""
    assert decode_splits(1, 4, 32768, sms=132) == 64  # capped
    assert decode_splits(8, 4, 32768, sms=132) == 9  # 8 * 4 * 9 >= 2 * 132 programs
    assert decode_splits(256, 4, 32768, sms=132) == 1
    assert decode_splits(1, 4, 600, sms=132) == 3  # ceil(600 / 256)
    assert decode_splits(4, 2, 10_000, sms=1) == 1  # interpreter: one "SM"
