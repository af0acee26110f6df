"""Triton kernels of the ``triton`` attention backend, exposed as plain functions on tensors.

- :mod:`.kv_write`: store a step's new K/V into the paged pool by slot mapping.
- :mod:`.decode`: paged decode attention (one query token per sequence), split-K + reduction.
- :mod:`.extend`: prefill/extend attention for packed variable-length query chunks.

Importing these modules imports ``triton``; ``TRITON_INTERPRET=1`` must be set before the first
import for the kernels to run on CPU tensors (Triton reads it when a kernel is decorated).
Every kernel reads K/V through the block table (``[num_seqs, max_blocks]`` int32, token ``p`` of a
sequence at slot ``block_table[p // block_size] * block_size + p % block_size``) and never gathers
a contiguous copy of a sequence's context.
"""

from __future__ import annotations

# Largest head_dim the kernels take: a head is one tile of next_power_of_2(head_dim) (>= 16, the
# smallest tl.dot operand), and 256 (Gemma's size) is the largest whose K/V tiles still fit in a
# GPU's shared memory at our tile sizes. Read by the backend selector without importing triton.
MAX_HEAD_DIM = 256

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); exp2 is the native instruction


def head_block(head_dim: int) -> int:
    """The tile width of one head: head_dim rounded up to a power of two, at least 16."""
    return max(16, 1 << (head_dim - 1).bit_length())


def dot_precision(dtype_is_fp32: bool) -> str:
    """``tl.dot`` input precision: exact IEEE fp32 for fp32 inputs (TF32's 10-bit mantissa would
    miss the 1e-3 fp32 tolerance), the default tensor-core path for bf16/fp16."""
    return "ieee" if dtype_is_fp32 else "tf32"
