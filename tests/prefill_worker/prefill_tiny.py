"""Test helpers: a tiny random Llama (fast on 2 CPU cores) and the one-shot reference runner."""

from __future__ import annotations

import torch

from pdserve.config import (
    CacheConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    SchedulerConfig,
    TransferConfig,
)
from pdserve.engine.batch import SampledToken, ScheduledSeq
from pdserve.engine.runner import ModelRunner
from pdserve.sampling_params import SamplingParams

TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    model_id="tiny-llama",
)


def tiny_config(
    num_blocks: int = 256,
    max_num_batched_tokens: int = 256,
    long_prefill_token_threshold: int = 0,
    enable_prefix_caching: bool = True,
    backend: str = "loopback",
) -> EngineConfig:
    """EngineConfig for the tiny dummy model (fp32, block size 16)."""
    return EngineConfig(
        load=LoadConfig(model="tiny", load_format="dummy", dtype="float32", seed=7),
        cache=CacheConfig(
            block_size=16, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=2048,
            long_prefill_token_threshold=long_prefill_token_threshold,
        ),
        transfer=TransferConfig(backend=backend, timeout_s=20.0),
    )


def prompt(n: int, seed: int) -> tuple[int, ...]:
    """``n`` random token ids of the tiny vocabulary (deterministic per seed)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist())


class OneShot:
    """The reference: each prompt alone, in one forward, on its own runner (same weights)."""

    def __init__(self) -> None:
        self.runner = ModelRunner(tiny_config(num_blocks=128), model_config=TINY)

    def run(
        self, tokens: tuple[int, ...], sampling: SamplingParams, num_output_tokens: int = 0
    ) -> tuple[SampledToken, torch.Tensor]:
        """(token 1, KV [L, 2, T, H, D]) of ``tokens`` computed in one chunk from scratch."""
        n = len(tokens)
        table = list(range(-(-n // 16)))
        k = num_output_tokens
        seq = ScheduledSeq(
            request_id="ref",
            token_ids=list(tokens),
            num_computed=0,
            block_table=table,
            sample=True,
            sampling=sampling,
            prompt_token_ids=list(tokens[: n - k]),
            output_token_ids=list(tokens[n - k :]),
        )
        (tok,) = self.runner.execute([seq])
        assert tok is not None
        return tok, self.runner.kv_pool.gather(table, n)
