"""Test helpers: a tiny random Llama (fast on 2 CPU cores) and the one-shot reference runner."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kv_transfer.base import KVLayout
from pdserve.config import (
    CacheConfig,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    SchedulerConfig,
    TransferConfig,
)
from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.runner import ModelRunner
from pdserve.kv_cache.pool import KVPool
from pdserve.sampling_params import SamplingParams
from pdserve.types import SampledToken

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
    long_prefill_token_threshold: int = 128,
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


def tiny_layout() -> KVLayout:
    """The KV layout of the tiny model in fp32 with blocks of 16 tokens."""
    return KVLayout(
        model_id=TINY.model_id,
        dtype="float32",
        num_layers=TINY.num_hidden_layers,
        num_kv_heads=TINY.num_key_value_heads,
        head_dim=TINY.head_dim,
        block_size=16,
    )


def spawn_receiver(num_blocks: int = 256) -> tuple[mp.process.BaseProcess, Connection, str]:
    """Start a decode-side receiver process (gloo, torch_dist). Returns (process, pipe, endpoint)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_child, args=(child, num_blocks), daemon=True)
    proc.start()
    child.close()
    return proc, parent, ask(parent)


def ask(conn: Connection, msg: Any = None, timeout_s: float = 60.0) -> Any:
    """Send ``msg`` (unless None) to the child and return its answer; re-raises its errors."""
    if msg is not None:
        conn.send(msg)
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer from the receiver process within {timeout_s} s")
    out = conn.recv()
    if isinstance(out, BaseException):
        raise out
    return out


def receiver_child(conn: Connection, num_blocks: int) -> None:
    """The receiver process: a TorchDistReceiver over its own pool, driven through the pipe.

    Sends its endpoint first; answers ``("expect", tid, blocks)`` with "ok" and
    ``("wait", tid, blocks)`` with ``(first_token, first_logprob, kv [L, 2, T, H, D])``.
    Exits when the pipe closes.
    """
    torch.set_num_threads(1)
    from kv_transfer.torch_dist import TorchDistReceiver

    lay = tiny_layout()
    pool = KVPool(lay.num_layers, num_blocks, 16, lay.num_kv_heads, lay.head_dim, torch.float32)
    rx = TorchDistReceiver(pool, lay, timeout_s=20.0)
    futures: dict[int, Any] = {}
    conn.send(rx.endpoint)
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            try:
                if cmd[0] == "expect":
                    futures[cmd[1]] = rx.expect(cmd[1], cmd[2], time.time() + 120)
                    conn.send("ok")
                elif cmd[0] == "wait":
                    res = futures.pop(cmd[1]).result(timeout=60)
                    conn.send(
                        (res.first_token, res.first_logprob, pool.gather(cmd[2], res.num_tokens))
                    )
            except Exception as e:  # noqa: BLE001 - every failure goes back to the test
                conn.send(e)
    finally:
        rx.close()
