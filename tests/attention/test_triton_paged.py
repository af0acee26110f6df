"""The triton backend end to end: mixed batches through the model interface, and a tiny Llama
generating the same greedy tokens as with torch_ref (Triton interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.base import get_backend
from pdserve.attention.triton_paged import TritonBackend

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mixed_batch_matches_torch_ref(paged_case, dtype: torch.dtype) -> None:
    """Decodes (one after a 1-token context), a prefix-cached chunk, a fresh prefill and a
    one-token prompt in one step: every row equals torch_ref, the pool holds the same K/V."""
    seqs = [(9, 1), (13, 6), (0, 11), (1, 1), (0, 1)]
    case = paged_case(seqs, 6, 2, 32, 4, dtype)
    backend = get_backend("triton")
    assert isinstance(backend, TritonBackend)
    case.assert_backend_matches(backend, case.tmeta)


def test_build_metadata() -> None:
    backend = TritonBackend()
    tm = backend.build_metadata([1, 3], [4, 0], [[2, 5], [7]], 4)
    assert tm.query_start_loc_i32.tolist() == [0, 1, 4] and tm.seq_lens.tolist() == [5, 3]
    assert tm.query_start_loc_i32.dtype == torch.int32 and tm.seq_lens.dtype == torch.int32
    assert tm.block_tables.dtype == torch.int32 and tm.block_tables.tolist() == [[2, 5], [7, 0]]
    assert (tm.num_decodes, tm.num_extends, tm.max_decode_seq_len) == (1, 1, 5)
    # the common fields the model reads: positions (RoPE) and the slot mapping (KV write)
    assert tm.positions.tolist() == [4, 0, 1, 2] and tm.slot_mapping.tolist() == [20, 28, 29, 30]
    tm2 = backend.build_metadata([1, 1], [4, 8], [[2, 5], [7, 1, 3]], 4)
    assert tm2.decode_ids is None and tm2.num_extends == 0
    with pytest.raises(ValueError, match="sequence 0: block table has 1 blocks"):
        backend.build_metadata([1], [4], [[2]], 4)


def test_tiny_llama_greedy_tokens_equal_torch_ref(greedy_tokens) -> None:  # noqa: ANN001
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 128, (n,), generator=gen).tolist() for n in (21, 5, 9)]
    assert greedy_tokens("triton", prompts) == greedy_tokens("torch_ref", prompts)
