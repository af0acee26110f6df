"""End to end on the bundled SmolLM2-135M-Instruct GGUF against transformers on the same file.

transformers dequantises the GGUF itself (its own loader and Q/K un-permutation), so agreement
checks our GGUF reading as well as the model, the paged KV cache and the runner.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from decode_worker.offline import OfflineEngine
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.model.resolve import resolve_model
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import Tokenizer, load_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NEW_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village nestled between two mountains, there lived",
    "List three primary colors:",
    "Water boils at a temperature of",
]
LONG_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press. Within fifty years "
    "printing shops had spread across Europe, books became far cheaper, and"
)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: on a shared 2-core machine, two spinning OpenMP threads per process make
    every small decode-step kernel wait on a descheduled partner (several times slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def prompts(tok: Tokenizer) -> list[list[int]]:
    chat = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}])
    return [tok.encode(t) for t in TEXTS] + [chat]


@pytest.fixture(scope="module")
def hf() -> Iterator[torch.nn.Module]:
    path = resolve_model("smollm2").path
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    assert model.dtype == torch.float32
    yield model


@pytest.fixture(scope="module")
def engine() -> OfflineEngine:
    cfg = EngineConfig(
        load=LoadConfig(model="smollm2", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=96),
    )
    return OfflineEngine(cfg)


def _hf_greedy(hf: torch.nn.Module, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=2
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def hf_outputs(hf: torch.nn.Module, prompts: list[list[int]]) -> list[list[int]]:
    return [_hf_greedy(hf, p) for p in prompts]


def test_logits_match_transformers(
    engine: OfflineEngine, hf: torch.nn.Module, prompts: list[list[int]]
) -> None:
    """Every position's logits, three prompts packed in one forward (prefill from scratch)."""
    runner = engine.runner
    chosen = prompts[:3]
    tables = [[0, 1], [2, 3], [4, 5]]
    meta = runner.model.attn_backend.build_metadata([len(p) for p in chosen], [0, 0, 0], tables, 16)
    ids = torch.tensor([t for p in chosen for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in chosen])
    with torch.no_grad():
        caches = [runner.kv_pool.layer(i) for i in range(runner.model_config.num_hidden_layers)]
        ours = runner.model.compute_logits(runner.model(ids, pos, meta, caches))
        for p, o in zip(chosen, ours.split([len(p) for p in chosen]), strict=True):
            ref = hf(torch.tensor([p])).logits[0]
            assert (o - ref).abs().max().item() < 5e-4
            assert torch.equal(o.argmax(-1), ref.argmax(-1))


def test_greedy_alone_and_batched_equal_transformers(
    engine: OfflineEngine, prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    for p, ref in zip(prompts, hf_outputs, strict=True):
        (out,) = engine.generate([p], GREEDY)
        assert out.output_token_ids == ref
    batched = engine.generate(prompts, GREEDY)  # mixed prompt lengths, one batch
    assert [o.output_token_ids for o in batched] == hf_outputs
    assert engine.kv.num_free_blocks == engine.runner.num_blocks  # everything freed


def test_prefill_split_into_three_chunks(
    engine: OfflineEngine, hf: torch.nn.Module, tok: Tokenizer
) -> None:
    ids = tok.encode(LONG_TEXT)
    chunk = -(-len(ids) // 3)
    cfg = EngineConfig(
        load=engine.config.load,
        cache=engine.config.cache,
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk),
    )
    chunked = OfflineEngine(cfg, runner=engine.runner)
    steps: list[list[tuple[int, int]]] = []
    execute = chunked.runner.execute

    def record(batch: list[ScheduledSeq]):  # type: ignore[no-untyped-def]
        steps.append([(s.num_computed, len(s.token_ids)) for s in batch])
        return execute(batch)

    chunked.runner.execute = record  # type: ignore[method-assign]
    try:
        (out,) = chunked.generate([ids], GREEDY)
    finally:
        del chunked.runner.execute
    assert steps[:3] == [[(0, chunk)], [(chunk, chunk)], [(2 * chunk, len(ids) - 2 * chunk)]]
    assert out.output_token_ids == _hf_greedy(hf, ids)


def test_prefix_cache_hit_same_output(engine: OfflineEngine, tok: Tokenizer) -> None:
    ids = tok.encode(LONG_TEXT)
    assert len(ids) > 40
    short = SamplingParams(temperature=0.0, max_tokens=8)
    (cold,) = engine.generate([ids], short)  # leaves its full blocks cached in the pool
    computed: list[int] = []
    execute = engine.runner.execute

    def record(batch: list[ScheduledSeq]):  # type: ignore[no-untyped-def]
        computed.append(sum(len(s.token_ids) for s in batch))
        return execute(batch)

    engine.runner.execute = record  # type: ignore[method-assign]
    try:
        (warm,) = engine.generate([ids[:40]], short)  # first 2 blocks of 16 are cached
        (warm_full,) = engine.generate([ids], short)
    finally:
        del engine.runner.execute
    assert warm.num_cached_tokens == 32 and computed[0] == len(ids[:40]) - 32
    assert warm_full.num_cached_tokens == (len(ids) - 1) // 16 * 16
    assert warm_full.output_token_ids == cold.output_token_ids
    (uncached,) = OfflineEngine(
        EngineConfig(load=engine.config.load, cache=CacheConfig(enable_prefix_caching=False)),
        runner=engine.runner,
    ).generate([ids[:40]], short)
    assert uncached.num_cached_tokens == 0
    assert warm.output_token_ids == uncached.output_token_ids


@pytest.mark.slow
def test_compiled_model_greedy_equals_transformers(
    prompts: list[list[int]], hf_outputs: list[list[int]]
) -> None:
    """What `pdserve serve` runs on CPU by default: the torch.compile'd decoder (compiled once
    here, 1-3 minutes on 2 busy cores with a cold inductor cache)."""
    cfg = EngineConfig(
        load=LoadConfig(model="smollm2", dtype="float32", torch_compile=True),
        cache=CacheConfig(block_size=16, num_blocks=96),
    )
    compiled = OfflineEngine(cfg)
    assert compiled.runner.compile_seconds > 0  # compiled, not fallen back to eager
    batched = compiled.generate(prompts, GREEDY)
    assert [o.output_token_ids for o in batched] == hf_outputs
    (alone,) = compiled.generate(prompts[-1:], GREEDY)
    assert alone.output_token_ids == hf_outputs[-1]
