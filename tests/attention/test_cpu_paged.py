"""The cpu_paged backend end to end: mixed batches through the backend interface, its metadata,
the split-K policy, and a tiny Llama generating the same greedy tokens as with torch_ref."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.base import get_backend
from pdserve.attention.cpu_paged import MIN_SPLIT_TOKENS, CpuPagedBackend, num_splits

pytestmark = pytest.mark.timeout(180)

CPU = torch.device("cpu")  # the paged_case fixture defaults to the GPU where there is one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_mixed_batch_matches_torch_ref(paged_case, dtype: torch.dtype) -> None:  # noqa: ANN001
    """Decodes (one after a 1-token context), a prefix-cached chunk, a fresh prefill and a
    one-token prompt in one step: every row equals torch_ref, the pool holds the same K/V."""
    seqs = [(9, 1), (13, 6), (0, 11), (1, 1), (0, 1), (40, 1)]
    case = paged_case(seqs, 6, 2, 32, 4, dtype, device=CPU)
    backend = get_backend("cpu_paged")
    assert isinstance(backend, CpuPagedBackend)
    qlens, computed = [n for _, n in seqs], [c for c, _ in seqs]
    case.assert_backend_matches(backend, backend.build_metadata(qlens, computed, case.tables, 4))


def test_decode_only_step_matches_torch_ref(paged_case) -> None:  # noqa: ANN001
    case = paged_case(
        [(c, 1) for c in (0, 3, 16, 129, 500)], 8, 2, 64, 16, torch.bfloat16, device=CPU
    )
    backend = get_backend("cpu_paged")
    meta = backend.build_metadata([1] * 5, [0, 3, 16, 129, 500], case.tables, 16)
    assert meta.decode.rows is None and not meta.prefills
    case.assert_backend_matches(backend, meta)


def test_build_metadata() -> None:
    backend = get_backend("cpu_paged")
    # a decode, a chunk after cached tokens, a one-token prompt (decoded by the kernel too)
    meta = backend.build_metadata([1, 3, 1], [4, 2, 0], [[2, 5], [7, 8], [9]], 4)
    d = meta.decode
    assert d.num_decodes == 2 and d.max_seq_len == 5 and d.max_block_id == 9 and d.max_row == 4
    assert d.rows is not None and d.rows.tolist() == [0, 4]
    assert d.block_tables.dtype == torch.int32
    assert d.block_tables.tolist() == [[2, 5], [9, 0]]  # 2 blocks cover 5 tokens
    assert d.seq_lens.dtype == torch.int32 and d.seq_lens.tolist() == [5, 1]
    (span,) = meta.prefills
    assert (span.start, span.end, span.num_computed, span.seq_len) == (1, 4, 2, 5)
    assert meta.positions.tolist() == [4, 2, 3, 4, 0]
    assert meta.slot_mapping.tolist() == [20, 30, 31, 32, 36]
    prefill_only = backend.build_metadata([3], [0], [[1]], 4)
    assert prefill_only.decode.num_decodes == 0 and len(prefill_only.prefills) == 1
    with pytest.raises(ValueError, match="sequence 0: block table has 1 blocks"):
        backend.build_metadata([1], [4], [[2]], 4)


def test_split_k_policy() -> None:
    # one thread, or plenty of sequences: no split
    assert num_splits(1, 32768, 1) == 1
    assert num_splits(16, 4096, 2) == 1
    # one long sequence on 4 threads: enough (sequence, split) items for every thread
    assert num_splits(1, 32768, 4) == 16
    assert num_splits(2, 32768, 4) == 8
    # never splits shorter than MIN_SPLIT_TOKENS
    assert num_splits(1, MIN_SPLIT_TOKENS * 2, 16) == 2
    assert num_splits(1, MIN_SPLIT_TOKENS - 1, 16) == 1
    assert num_splits(0, 0, 8) == 1


def test_tiny_llama_greedy_tokens_equal_torch_ref(greedy_tokens) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (21, 5, 9, 1)]
    assert greedy_tokens("cpu_paged", prompts) == greedy_tokens("torch_ref", prompts)
