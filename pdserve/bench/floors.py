"""The hardware floors of a serving run: the time no server could beat on the measured machine.

A run's work is fixed by its requests (prompt tokens ``P`` and output tokens ``O`` of each), so two
lower bounds on its duration follow from the machine's measured rates (:mod:`pdserve.bench.machine`),
in the manner of a roofline (Williams, Waterman and Patterson, CACM 2009):

**Arithmetic floor** = total matmul FLOPs / measured matmul rate. Per request, with ``W`` the
weights of the decoder layers' matmuls (q, k, v, o, gate, up, down), ``V x H`` the LM head, and
``A = 4 * layers * heads * head_dim`` the attention FLOPs per (query, key) pair (``q.k`` and
``p.v``, 2 FLOPs per multiply-add each)::

    prefill(P)   = 2 P W + 2 V H + A * P (P + 1) / 2          (causal: query i sees i keys;
                                                              logits of the last prompt token)
    decode(P, O) = (O - 1) (2 W + 2 V H) + A * sum_{j=1}^{O-1} (P + j)
                                                             (token 1 comes from the prefill)

Norms, activations, rotary and sampling are left out (they are not matmul work), so the floor is
below what any real forward needs.

**Memory floor** = bytes a decode must read / measured copy bandwidth: every decode step reads
the weights once (all parameters; an untied embedding table is only looked up, so it is left
out) and each running sequence's KV::

    bytes  = steps * weight_bytes + kv_bytes_per_token * sum_requests sum_{j=1}^{O-1} (P + j)
    steps  = max(max_i (O_i - 1), ceil(sum_i (O_i - 1) / max_batch))

``steps`` is the fewest decode steps a scheduler could take with at most ``max_batch`` sequences
per step (the clients' concurrency caps). Prefill's reads are left out (it is compute-bound).

The run's floor is the larger of the two; ``duration / floor`` says how far a server is from the
hardware. Prefix-cache hits make the real work smaller than counted here (random prompts share
at most a chat template's few tokens).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.config import ModelConfig


@dataclass(frozen=True)
class ModelCost:
    """Per-token work of one model in one dtype (counts from the config, no weights read).

    ``params``: every parameter once (a tied embedding once); ``layer_matmul_params``: ``W``
    above; ``lm_head_params``: ``V x H``; ``embedding_params``: ``V x H`` of the input table;
    ``attn_flops_per_pair``: ``A`` above; ``dtype_bytes``: bytes per weight and KV element.
    """

    params: int
    layer_matmul_params: int
    lm_head_params: int
    embedding_params: int
    tied: bool
    attn_flops_per_pair: int
    kv_elems_per_token: int
    dtype_bytes: int

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads: all but an untied embedding table."""
        read = self.params if self.tied else self.params - self.embedding_params
        return read * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (keys and values)."""
        return self.kv_elems_per_token * self.dtype_bytes


def model_cost(mc: ModelConfig, dtype: str) -> ModelCost:
    """:class:`ModelCost` of ``mc`` in ``dtype`` ('float32' | 'bfloat16' | ...).

    Builds the pdserve model on torch's meta device (no memory, no weights) and counts its
    parameters and ``nn.Linear`` weights, so every registered architecture is counted as served.
    Raises ConfigError for an unsupported architecture, AttributeError for an unknown dtype.
    """
    import torch

    from pdserve.model.registry import get_model_class

    with torch.device("meta"):
        model = get_model_class(mc.architecture)(mc)
    params = sum(p.numel() for p in model.parameters())
    layer_linear = sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m is not model.lm_head
    )
    vh = mc.vocab_size * mc.hidden_size
    return ModelCost(
        params=params,
        layer_matmul_params=layer_linear,
        lm_head_params=vh,
        embedding_params=vh,
        tied=mc.tie_word_embeddings,
        attn_flops_per_pair=4 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim,
        kv_elems_per_token=mc.kv_bytes_per_token,
        dtype_bytes=torch.empty((), dtype=getattr(torch, dtype)).element_size(),
    )


def prefill_flops(cost: ModelCost, prompt_len: int) -> float:
    """Matmul FLOPs of prefilling ``prompt_len`` tokens (module docstring, ``prefill(P)``)."""
    p = prompt_len
    return (
        2 * p * cost.layer_matmul_params
        + 2 * cost.lm_head_params
        + cost.attn_flops_per_pair * p * (p + 1) / 2
    )


def _decoded_context(prompt_len: int, output_len: int) -> float:
    """``sum_{j=1}^{O-1} (P + j)``: keys read over a request's decode steps."""
    d = max(0, output_len - 1)
    return d * prompt_len + d * (d + 1) / 2


def decode_flops(cost: ModelCost, prompt_len: int, output_len: int) -> float:
    """Matmul FLOPs of the ``output_len - 1`` decode steps after a prefill of ``prompt_len``."""
    d = max(0, output_len - 1)
    per_token = 2 * cost.layer_matmul_params + 2 * cost.lm_head_params
    return d * per_token + cost.attn_flops_per_pair * _decoded_context(prompt_len, output_len)


def min_decode_steps(decodes: Iterable[int], max_batch: int) -> int:
    """Fewest decode steps for requests needing ``decodes`` steps each, ``max_batch`` per step.

    Raises ValueError when ``max_batch`` < 1.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    ds = [d for d in decodes if d > 0]
    if not ds:
        return 0
    return max(max(ds), math.ceil(sum(ds) / max_batch))


@dataclass(frozen=True)
class RunFloors:
    """Floors of one run. FLOPs, bytes, seconds; ``bound`` is 'compute' or 'memory'."""

    flops: float
    bytes_read: float
    decode_steps: int
    arithmetic_s: float
    memory_s: float

    @property
    def floor_s(self) -> float:
        """The larger of the two floors (s)."""
        return max(self.arithmetic_s, self.memory_s)

    @property
    def bound(self) -> str:
        """Which floor is higher: 'compute' or 'memory'."""
        return "compute" if self.arithmetic_s >= self.memory_s else "memory"

    def to_dict(self) -> dict[str, Any]:
        """JSON form, with ``floor_s`` and ``bound``."""
        return {**asdict(self), "floor_s": self.floor_s, "bound": self.bound}


def run_floors(
    cost: ModelCost,
    requests: Iterable[tuple[int, int]],
    max_batch: int,
    gflops: float,
    copy_gbs: float,
) -> RunFloors:
    """Floors of a run whose completed requests had ``(prompt_tokens, output_tokens)`` each.

    ``max_batch``: most sequences the clients kept in flight (sum of their concurrency caps);
    ``gflops`` / ``copy_gbs``: the measured matmul rate (GFLOP/s) and copy bandwidth (GB/s).
    Requests with no output tokens (failed) count nothing. Raises ValueError for rates <= 0.
    """
    if not (gflops > 0 and copy_gbs > 0):
        raise ValueError(f"rates must be > 0, got {gflops} GFLOP/s and {copy_gbs} GB/s")
    done = [(p, o) for p, o in requests if o > 0]
    flops = sum(prefill_flops(cost, p) + decode_flops(cost, p, o) for p, o in done)
    steps = min_decode_steps((o - 1 for _, o in done), max_batch)
    kv = cost.kv_bytes_per_token * sum(_decoded_context(p, o) for p, o in done)
    bytes_read = steps * cost.weight_bytes_per_step + kv
    return RunFloors(
        flops=flops,
        bytes_read=bytes_read,
        decode_steps=steps,
        arithmetic_s=flops / (gflops * 1e9),
        memory_s=bytes_read / (copy_gbs * 1e9),
    )


def decode_step_floor_ms(
    cost: ModelCost, batch: int, context: float, copy_gbs: float, gflops: float
) -> tuple[float, str]:
    """Lower bound on one decode step of ``batch`` sequences at ``context`` tokens each (ms), and
    which resource bounds it ('memory' | 'compute'): the weights once plus the batch's KV over
    the copy bandwidth, against ``batch`` tokens' matmul and attention FLOPs over the matmul
    rate."""
    bytes_read = cost.weight_bytes_per_step + batch * context * cost.kv_bytes_per_token
    per_token = 2 * cost.layer_matmul_params + 2 * cost.lm_head_params
    flops = batch * (per_token + cost.attn_flops_per_pair * context)
    mem_ms = bytes_read / (copy_gbs * 1e9) * 1e3
    cmp_ms = flops / (gflops * 1e9) * 1e3
    return (mem_ms, "memory") if mem_ms >= cmp_ms else (cmp_ms, "compute")
