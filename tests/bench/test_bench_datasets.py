"""Benchmark workloads: exact prompt lengths, ranges, shared prefixes, mixes and trace parsing."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.bench.datasets import (
    DatasetError,
    PromptBuilder,
    jsonl_requests,
    mixed_requests,
    random_requests,
    shared_prefix_requests,
)
from pdserve.bench.word_tokenizer import WordTokenizer, load_bench_tokenizer


@pytest.fixture(scope="module")
def bpe_tokenizer() -> object:
    """A small byte-level BPE tokenizer trained in memory: real sub-word merges, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [
        "the quick brown fox jumps over the lazy dog while prefill and decode run apart",
        "paged attention keeps key value blocks in a pool; a block table maps tokens to slots",
        "throughput latency goodput ttft tpot itl e2el benchmark serving requests per second",
    ] * 20
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("which", ["words", "bpe"])
def test_random_prompts_have_exact_lengths(which: str, bpe_tokenizer: object) -> None:
    tok = WordTokenizer() if which == "words" else bpe_tokenizer
    reqs = random_requests(tok, 12, input_len=40, output_len=8, seed=3)  # type: ignore[arg-type]
    for r in reqs:
        assert r.prompt_len == 40 == len(tok.encode(r.prompt, add_special_tokens=False))
        assert r.output_len == 8 and r.label == "random"
    assert len({r.prompt for r in reqs}) == 12
    again = random_requests(tok, 12, input_len=40, output_len=8, seed=3)  # type: ignore[arg-type]
    assert [r.prompt for r in again] == [r.prompt for r in reqs]  # seeded


def test_range_ratio_and_shared_prefix(bpe_tokenizer: object) -> None:
    tok = bpe_tokenizer
    reqs = random_requests(tok, 60, 20, 10, range_ratio=0.5, prefix_len=16, seed=1)  # type: ignore[arg-type]
    prefix = reqs[0].prompt.split(" ")[0]
    ins = [r.prompt_len - 16 for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 10 and max(ins) <= 30 and len(set(ins)) > 5
    assert min(outs) >= 5 and max(outs) <= 15 and len(set(outs)) > 3
    assert all(r.prompt.startswith(prefix) for r in reqs)
    for r in reqs:
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len  # type: ignore[attr-defined]


def test_shared_prefix_groups() -> None:
    tok = WordTokenizer()
    reqs = shared_prefix_requests(tok, num_groups=3, prompts_per_group=4, system_len=50,
                                  question_len=10, output_len=7, seed=0)  # fmt: skip
    assert len(reqs) == 12 and {r.prompt_len for r in reqs} == {60}
    by_group: dict[str, set[str]] = {}
    for r in reqs:
        assert r.messages is not None and r.messages[0][0] == "system"
        by_group.setdefault(r.label, set()).add(r.messages[0][1])
        assert r.prompt == f"{r.messages[0][1]} {r.messages[1][1]}"
        assert r.chat_messages()[1] == {"role": "user", "content": r.messages[1][1]}
    assert all(len(systems) == 1 for systems in by_group.values()) and len(by_group) == 3
    assert [r.label for r in reqs] != sorted(r.label for r in reqs)  # shuffled


def test_mixed_fraction_and_lengths() -> None:
    tok = WordTokenizer()
    reqs = mixed_requests(tok, 40, long_fraction=0.25, short_input_len=16, short_output_len=32,
                          long_input_len=300, long_output_len=8, seed=2)  # fmt: skip
    longs = [r for r in reqs if r.label == "long"]
    shorts = [r for r in reqs if r.label == "short"]
    assert len(longs) == 10 and len(shorts) == 30
    assert {r.prompt_len for r in longs} == {300} and {r.output_len for r in longs} == {8}
    assert {r.prompt_len for r in shorts} == {16} and {r.output_len for r in shorts} == {32}
    assert all(r.prompt.startswith("Answer the question using only the documents") for r in longs)
    assert [r.label for r in reqs[:10]] != ["long"] * 10  # interleaved, not front-loaded
    with pytest.raises(DatasetError, match="--mixed-long-fraction"):
        mixed_requests(tok, 4, 1.5, 8, 8, 100, 8)
    with pytest.raises(DatasetError, match="--mixed-long-input-len"):
        mixed_requests(tok, 4, 0.5, 8, 8, 3, 8)


def test_jsonl_trace(tmp_path: Path) -> None:
    tok = WordTokenizer()
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"prompt": "hello big world", "output_len": 5}\n\n'
        '{"input_length": 12, "output_length": 3}\n'
    )
    reqs = jsonl_requests(tok, p)
    assert [(r.prompt_len, r.output_len, r.timestamp) for r in reqs] == [
        (3, 5, None),
        (12, 3, None),
    ]
    assert len(jsonl_requests(tok, p, num_prompts=1)) == 1
    scaled = tmp_path / "s.jsonl"
    scaled.write_text('{"timestamp": 5, "prompt_len": 2, "output_len": 1}\n'
                      '{"timestamp": 3, "prompt_len": 2, "output_len": 1}\n')  # fmt: skip
    assert [r.timestamp for r in jsonl_requests(tok, scaled, time_scale=0.5)] == [0.0, 1.0]


@pytest.mark.parametrize(
    ("line", "msg"),
    [
        ("not json", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"prompt": "x"}', "missing 'output_len'"),
        ('{"prompt": "", "output_len": 2}', "'prompt' must be a non-empty string"),
        ('{"output_len": 2}', "missing 'prompt_len'"),
        ('{"prompt_len": 2.5, "output_len": 2}', "'prompt_len' must be a positive integer"),
        ('{"prompt_len": 2, "output_len": 2, "timestamp": -1}', "'timestamp' must be a number"),
    ],
)
def test_jsonl_errors_name_line_and_field(tmp_path: Path, line: str, msg: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt_len": 2, "output_len": 2}\n' + line + "\n")
    with pytest.raises(DatasetError, match=msg) as e:
        jsonl_requests(WordTokenizer(), p)
    assert f"{p}:2" in str(e.value)


def test_argument_errors(tmp_path: Path) -> None:
    tok = WordTokenizer()
    with pytest.raises(DatasetError, match="--random-input-len must be > 0"):
        random_requests(tok, 2, 0, 4)
    with pytest.raises(DatasetError, match="--random-range-ratio"):
        random_requests(tok, 2, 4, 4, range_ratio=1.0)
    with pytest.raises(DatasetError, match="--shared-prefix-system-len"):
        shared_prefix_requests(tok, 1, 1, 0, 4, 4)
    with pytest.raises(DatasetError, match="file not found"):
        jsonl_requests(tok, tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DatasetError, match="holds no requests"):
        jsonl_requests(tok, empty)


def test_word_tokenizer_round_trip() -> None:
    tok = load_bench_tokenizer("builtin")
    assert isinstance(tok, WordTokenizer) and tok.vocab_size == 4900
    ids = list(range(0, 4900, 97))
    assert tok.encode(tok.decode(ids)) == ids
    assert len(tok.encode("unknown words map to one id each")) == 7
    text, n = PromptBuilder(tok, __import__("numpy").random.default_rng(0)).text(9, "sys prompt")
    assert n == 11 and len(text.split()) == 9
