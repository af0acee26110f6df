"""Paged prefill/extend kernel against torch_ref, under the Triton interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.triton_kernels.extend import BLOCK_M, paged_extend_attention

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _extend(case, out: torch.Tensor, max_query_len: int, seq_ids=None) -> None:  # noqa: ANN001
    tm = case.tmeta
    paged_extend_attention(
        case.q, case.k_cache, case.v_cache, tm.block_tables, tm.seq_lens, tm.query_start_loc_i32,
        out, case.scale, max_query_len, seq_ids=seq_ids,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 3, 7])
def test_extend_matches_torch_ref(paged_case, group: int, dtype: torch.dtype) -> None:
    # fresh prefill; prefix-cached extends after 13 (not a block multiple) and 16 (one) tokens;
    # a chunk longer than one BLOCK_M tile after a short prefix; a one-token prompt
    seqs = [(0, 10), (13, 7), (16, 16), (5, BLOCK_M + 6), (0, 1)]
    case = paged_case(seqs, 2 * group, 2, 32, 8, dtype, seed=10 + group)
    out = case.poisoned()
    _extend(case, out, max(n for _, n in seqs))
    assert case.err(out) < case.tolerance


def test_extend_writes_only_its_sequences(paged_case) -> None:
    """With seq_ids, only those sequences' rows are written (decodes are left to their kernel)."""
    seqs = [(4, 1), (6, 9), (9, 1), (0, 5)]
    case = paged_case(seqs, 4, 4, 16, 4, torch.float32)
    tm = case.tmeta
    assert tm.extend_ids is not None and tm.extend_ids.tolist() == [1, 3]
    assert tm.max_extend_query_len == 9
    out = case.poisoned()
    _extend(case, out, tm.max_extend_query_len, tm.extend_ids)
    rows = torch.tensor(list(range(1, 10)) + list(range(11, 16)))
    assert case.err(out, rows) < case.tolerance
    assert out[[0, 10]].isnan().all()
