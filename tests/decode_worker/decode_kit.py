"""Shared helpers for decode-worker tests: tiny random-weight engines and an event collector.

Imported by the test modules beside it (pytest puts this directory on sys.path).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable

from decode_worker.engine import DecodeEngine
from decode_worker.request import DecodeEvent, DecodeRequest, TokensEvent, is_terminal
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, ModelConfig, SchedulerConfig
from pdserve.sampling_params import SamplingParams

TINY = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    eos_token_ids=(127,),
    model_id="tiny-random-llama",
)


def tiny_config(
    *,
    num_blocks: int = 256,
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    chunk: int = 0,
    prefix_caching: bool = False,
    max_model_len: int = 256,
) -> EngineConfig:
    """An EngineConfig for the TINY model with dummy (seeded random) weights, float32 on CPU."""
    return EngineConfig(
        load=LoadConfig(load_format="dummy", dtype="float32", seed=0),
        cache=CacheConfig(
            block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix_caching
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=chunk,
        ),
    )


def tiny_engine(**kw: object) -> DecodeEngine:
    """A DecodeEngine on TINY; keyword args go to :func:`tiny_config` except ``receiver``,
    ``clock`` (wall seconds, for deadlines) and ``prefill_thread``."""
    receiver = kw.pop("receiver", None)
    clock = kw.pop("clock", time.time)
    prefill_thread = bool(kw.pop("prefill_thread", False))
    return DecodeEngine(
        tiny_config(**kw),  # type: ignore[arg-type]
        model_config=TINY,
        receiver=receiver,  # type: ignore[arg-type]
        clock=clock,  # type: ignore[arg-type]
        prefill_thread=prefill_thread,
    )


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def prompt(i: int, n: int) -> tuple[int, ...]:
    """A deterministic prompt of ``n`` ids (never EOS 127)."""
    return tuple((7 * i + 3 * k + 1) % 120 for k in range(n))


class Collector:
    """Per-request event lists; ``sink(rid)`` is the engine sink. Thread-safe."""

    def __init__(self) -> None:
        self.events: dict[str, list[DecodeEvent]] = defaultdict(list)
        self._cv = threading.Condition()

    def sink(self, rid: str) -> Callable[[DecodeEvent], None]:
        def put(ev: DecodeEvent) -> None:
            with self._cv:
                self.events[rid].append(ev)
                self._cv.notify_all()

        return put

    def tokens(self, rid: str) -> list[int]:
        return [
            t.token_id for e in self.events[rid] if isinstance(e, TokensEvent) for t in e.tokens
        ]

    def last(self, rid: str) -> DecodeEvent | None:
        evs = self.events.get(rid)
        return evs[-1] if evs else None

    def done(self, rid: str) -> bool:
        ev = self.last(rid)
        return ev is not None and is_terminal(ev)

    def wait(self, rids: list[str], timeout_s: float = 30.0) -> None:
        with self._cv:
            ok = self._cv.wait_for(lambda: all(self.done(r) for r in rids), timeout_s)
        assert ok, f"not finished in {timeout_s} s: {[r for r in rids if not self.done(r)]}"


def run_solo(engine: DecodeEngine, req: DecodeRequest) -> list[int]:
    """Run ``req`` alone on ``engine`` (unified mode) and return its output token ids."""
    col = Collector()
    engine.add_request(req, col.sink(req.request_id))
    engine.run_until_idle()
    assert col.done(req.request_id), col.events[req.request_id]
    return col.tokens(req.request_id)
