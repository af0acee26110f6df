"""Tokenizer loading, chat templates, streaming detokenization and stop strings.

Fast tests use two tokenizers built here: a tiny byte-level BPE written as a GGUF file (every
non-ASCII byte is its own token, so every multi-byte character is split across tokens) and a
SentencePiece-style BPE with byte fallback and a leading-space-stripping decoder, saved as a
Hugging Face directory. The e2e tests load SmolLM2's tokenizer from the bundled GGUF once.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pdserve.tokenizer.hf as hf_mod
from pdserve.config import ConfigError
from pdserve.model.gguf_file import read_gguf_metadata
from pdserve.tokenizer import (
    IncrementalDetokenizer,
    StopMatcher,
    Tokenizer,
    TokenizerError,
    clear_tokenizer_cache,
    load_tokenizer,
)
from pdserve.tokenizer.detokenizer import CONTEXT_TOKENS, MAX_PENDING_TOKENS, REBASE_EVERY

FFFD = "\ufffd"
MIXED_TEXT = "Hello 😀 world! 你好，世界。🎉🇫🇷 café naïve ✓ 👨‍👩‍👧 end"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# -- fixtures -------------------------------------------------------------------------------------


def _byte_alphabet() -> list[str]:
    """The byte-level BPE alphabet: byte b -> a printable character (GPT-2's scheme)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _write_tiny_gguf(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    tokens = TINY_SPECIALS + _byte_alphabet() + ["Ġt", "he", "Ġthe", "Ġa"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(TINY_SPECIALS) + [1] * (len(tokens) - len(TINY_SPECIALS)))
    w.add_token_merges(["Ġ t", "h e", "Ġt he", "Ġ a"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(0)
    w.add_add_bos_token(False)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _write_sentencepiece_dir(d: Path) -> Path:
    """A Llama-2-style tokenizer: '▁' word pieces, byte fallback, decoder strips one lead space."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello world, the cat sat on the mat.", "The capital of France is Paris!"] * 10
    trainer_tok = RawTokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    trainer_tok.train_from_iterator(corpus, trainer)
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(model["vocab"]) + b
    merges = [tuple(m) for m in model["merges"]]
    raw = RawTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    raw.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    raw.add_special_tokens(["<unk>", "<s>", "</s>"])
    raw.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    hf.save_pretrained(str(d))
    return d


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny(tiny_gguf: Path) -> Tokenizer:
    return load_tokenizer(str(tiny_gguf), use_disk_cache=False)


@pytest.fixture(scope="module")
def sp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_sentencepiece_dir(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def sp(sp_dir: Path) -> Tokenizer:
    return load_tokenizer(str(sp_dir))


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return load_tokenizer("smollm2")


def _stream(tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True):
    d = IncrementalDetokenizer(tok, prompt or (), skip_special_tokens=skip)
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    return pieces


def _byte_token_ids(tok: Tokenizer, data: bytes) -> list[int]:
    """One byte-level token per byte of ``data`` (splits every multi-byte character)."""
    alphabet = _byte_alphabet()
    return [tok.hf.convert_tokens_to_ids(alphabet[b]) for b in data]


# -- loading --------------------------------------------------------------------------------------


def test_gguf_tokenizer_facts(tiny: Tokenizer) -> None:
    # eos from the tokenizer (<|im_end|> = 2) first, then the GGUF's eot (0).
    assert tiny.eos_token_ids == (2, 0)
    assert tiny.bos_token_id == 1
    assert tiny.vocab_size == len(TINY_SPECIALS) + 256 + 4
    assert tiny.encode("the") == tiny.encode("the", add_special_tokens=True)  # add_bos false
    assert tiny.decode(tiny.encode(MIXED_TEXT)) == MIXED_TEXT


def test_cached_per_path(tiny_gguf: Path, tiny: Tokenizer) -> None:
    assert load_tokenizer(str(tiny_gguf), use_disk_cache=False) is tiny


def test_disk_cache_round_trip(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hf_mod, "DISK_CACHE_DIR", tmp_path / "cache")
    clear_tokenizer_cache()
    first = load_tokenizer(str(tiny_gguf))
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    clear_tokenizer_cache()
    second = load_tokenizer(str(tiny_gguf))  # from the disk entry
    assert second is not first
    assert second.eos_token_ids == first.eos_token_ids
    assert second.encode(MIXED_TEXT) == first.encode(MIXED_TEXT)
    msgs = [{"role": "user", "content": "hi"}]
    assert second.render_chat(msgs) == first.render_chat(msgs)
    clear_tokenizer_cache()


def test_hf_dir_eos_from_generation_config(tmp_path: Path, sp_dir: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    for f in sp_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    tok = load_tokenizer(str(d))
    assert tok.eos_token_ids == (2, 7)


def test_sentencepiece_bos_matches_transformers(sp: Tokenizer) -> None:
    ids = sp.encode("The cat")
    assert ids[0] == sp.bos_token_id == 1
    assert ids == list(sp.hf("The cat").input_ids)
    assert sp.encode("The cat", add_special_tokens=False) == ids[1:]


def test_missing_model_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_tokenizer(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="cannot load a tokenizer"):
        load_tokenizer(str(tmp_path))


# -- chat template --------------------------------------------------------------------------------


def test_chat_template_from_gguf(tiny: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    text = tiny.render_chat(msgs)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tiny.apply_chat_template(msgs)
    assert ids[0] == 1 and ids.count(1) == 2  # special tokens recognised, not spelled out
    assert tiny.decode(ids, skip_special_tokens=False) == text
    no_prompt = tiny.render_chat(msgs, add_generation_prompt=False)
    assert no_prompt == "<|im_start|>user\nhi<|im_end|>\n"


def test_no_chat_template_is_a_clear_error(sp: Tokenizer) -> None:
    assert not sp.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        sp.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\] needs a non-empty string 'role'"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ],
)
def test_malformed_messages(tiny: Tokenizer, messages: object, match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        tiny.render_chat(messages)  # type: ignore[arg-type]


def test_chat_template_from_hf_dir(tmp_path: Path, sp_dir: Path) -> None:
    d = tmp_path / "with_template"
    d.mkdir()
    for f in sp_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    tok = load_tokenizer(str(d))
    assert tok.has_chat_template
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.render_chat(msgs) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_exception_is_wrapped(tmp_path: Path) -> None:
    template = "{{ raise_exception('roles must alternate') }}"
    tok = load_tokenizer(str(_write_tiny_gguf(tmp_path / "t.gguf", template)), use_disk_cache=False)
    with pytest.raises(TokenizerError, match="roles must alternate"):
        tok.render_chat([{"role": "user", "content": "hi"}])


# -- incremental detokenizer ----------------------------------------------------------------------


def test_split_characters_never_emit_replacement(tiny: Tokenizer) -> None:
    ids = _byte_token_ids(tiny, MIXED_TEXT.encode())
    pieces = _stream(tiny, ids)
    assert "".join(pieces) == tiny.decode(ids) == MIXED_TEXT
    assert not any(FFFD in p for p in pieces)
    assert "😀" in pieces and "你" in pieces  # each emitted whole, once complete


def test_special_tokens_skipped_or_kept(tiny: Tokenizer) -> None:
    ids = [1, *tiny.encode("the"), 2]
    assert "".join(_stream(tiny, ids)) == "the"
    assert "".join(_stream(tiny, ids, skip=False)) == "<|im_start|>the<|im_end|>"


def test_invalid_bytes_are_flushed_as_replacement(tiny: Tokenizer) -> None:
    ids = _byte_token_ids(tiny, b"\x80" * (MAX_PENDING_TOKENS + 4) + b"ok\xf0\x9f")
    pieces = _stream(tiny, ids)
    assert "".join(pieces) == tiny.decode(ids)
    assert pieces[-1] == FFFD  # the truncated emoji at the very end comes out on flush only


def test_window_is_bounded(tiny: Tokenizer) -> None:
    lengths: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(ids))
            return tiny.decode(ids, skip_special_tokens)

    ids = _byte_token_ids(tiny, (MIXED_TEXT * 20).encode())
    d = IncrementalDetokenizer(Counting(), tiny.encode("prompt text"))
    text = "".join(d.add(i) for i in ids) + d.flush()
    assert text == MIXED_TEXT * 20
    assert max(lengths) <= CONTEXT_TOKENS + REBASE_EVERY + MAX_PENDING_TOKENS + 1
    assert len(lengths) < 1.2 * len(ids)  # about one decode per token


def test_sentencepiece_leading_space(sp: Tokenizer) -> None:
    prompt = sp.encode("The capital of France is", add_special_tokens=False)
    out = sp.encode("Paris 😀 你好", add_special_tokens=False)
    assert sp.hf.convert_ids_to_tokens(out[:1]) == ["▁Pa"]
    alone = _stream(sp, out)
    assert "".join(alone) == sp.decode(out) == "Paris 😀 你好"
    in_context = _stream(sp, out, prompt)
    expected = sp.decode(prompt + out)[len(sp.decode(prompt)) :]
    assert "".join(in_context) == expected == " Paris 😀 你好"
    assert not any(FFFD in p for p in alone + in_context)


def test_prompt_ending_inside_a_character(tiny: Tokenizer) -> None:
    data = "x😀".encode()
    ids = _byte_token_ids(tiny, data)
    pieces = _stream(tiny, ids[3:], prompt=ids[:3])  # prompt = 'x' + first two emoji bytes
    assert "".join(pieces) == tiny.decode(ids[3:])


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_smollm2_stream_emoji_cjk(smol: Tokenizer) -> None:
    text = "Emoji 😀🎉👨‍👩‍👧 and CJK 你好，世界。日本語のテキスト 한국어 done."
    ids = smol.encode(text)
    for prompt in ([], smol.encode("Say something:")):
        pieces = _stream(smol, ids, prompt)
        assert "".join(pieces) == smol.decode(ids) == text
        assert not any(FFFD in p for p in pieces)


_CHARS = st.sampled_from(
    list("ab ,.\n") + ["😀", "🎉", "你", "好", "世", "é", "ß", "한", "👍🏽", "€"]
)


@pytest.mark.e2e
@pytest.mark.timeout(120)
@settings(max_examples=40, deadline=None)
@given(text=st.lists(_CHARS, max_size=30).map("".join))
def test_smollm2_stream_property(smol: Tokenizer, text: str) -> None:
    ids = smol.encode(text)
    pieces = _stream(smol, ids)
    assert "".join(pieces) == smol.decode(ids) == text
    assert not any(FFFD in p for p in pieces)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_smollm2_chat_template(smol: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = smol.render_chat(msgs)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = smol.apply_chat_template(msgs)
    assert ids[0] == 1 and ids[-4:] == smol.encode("<|im_start|>assistant\n")
    assert smol.decode(ids, skip_special_tokens=False) == text
    assert smol.eos_token_ids == (2,)
    assert smol.vocab_size == 49152


@pytest.mark.e2e
def test_smollm2_gguf_metadata() -> None:
    from pdserve.model.resolve import smollm2_path

    meta = read_gguf_metadata(smollm2_path())
    assert meta["general.architecture"] == "llama"
    assert meta["tokenizer.ggml.eos_token_id"] == 2
    assert meta["llama.block_count"] == 30


def test_gguf_metadata_skips_arrays(tiny_gguf: Path) -> None:
    meta = read_gguf_metadata(tiny_gguf)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.eot_token_id"] == 0
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert "tokenizer.ggml.tokens" not in meta


def test_gguf_metadata_rejects_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 40)
    with pytest.raises(ConfigError, match="not a GGUF file"):
        read_gguf_metadata(bad)
    good = _write_tiny_gguf(tmp_path / "t.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[:300])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        read_gguf_metadata(tmp_path / "cut.gguf")


# -- stop strings ---------------------------------------------------------------------------------


def test_stop_inside_one_piece() -> None:
    m = StopMatcher(["DE"])
    assert m.feed("AB") == ("AB", False)
    assert m.feed("CDEF") == ("C", True)
    assert m.matched == "DE" and m.stopped
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_stop_string_kept_with_include_stop() -> None:
    """vLLM's include_stop_str_in_output: the text ends with the stop string, even across pieces."""
    m = StopMatcher(["DE"], include_stop=True)
    assert m.feed("ABCD") == ("ABC", False)
    assert m.feed("EF") == ("DE", True)
    assert m.matched == "DE" and m.flush() == ""
    assert StopMatcher(["world", "lo w"], include_stop=True).feed("hello world") == (
        "hello w",
        True,
    )


def test_stop_across_pieces() -> None:
    m = StopMatcher(["DE", "XYZ"])
    assert m.feed("ABCD") == ("ABC", False)  # "D" held: it may start "DE"
    assert m.feed("X") == ("D", False)  # "X" held: it may start "XYZ"
    assert m.feed("Y") == ("", False)
    assert m.feed("Zq") == ("", True)
    assert m.matched == "XYZ"


def test_held_tail_released_at_end() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("text </e") == ("text ", False)
    assert m.flush() == "</e"


def test_first_completed_stop_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)
    assert m.matched == "lo w"
    # "a" completes before "baa" does, in one piece or in two.
    for pieces in (["baa"], ["ba", "a"], ["b", "a", "a"]):
        m = StopMatcher(["baa", "a"])
        out = [m.feed(p) for p in pieces]
        assert "".join(t for t, _ in out) == "b" and out[-1][1] and m.matched == "a"
    # Two stops completing at the same character: the one starting first wins.
    m = StopMatcher(["bc", "abc"])
    assert m.feed("xabcd") == ("x", True)
    assert m.matched == "abc"


def test_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""


@pytest.mark.parametrize("stops", [[""], "DE", [None]])
def test_bad_stops_rejected(stops: object) -> None:
    with pytest.raises(ValueError, match="stop"):
        StopMatcher(stops)  # type: ignore[arg-type]


_ALPHA = st.text(alphabet="abcd", max_size=40)


@settings(max_examples=300, deadline=None)
@given(
    text=_ALPHA,
    stops=st.lists(st.text(alphabet="abcd", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=12),
)
def test_stop_matcher_property(text: str, stops: list[str], cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    # The first stop to complete (smallest end; on a tie the earliest start) ends the text.
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    expected = text[: min(hits)[1]] if hits else text

    m = StopMatcher(stops)
    out = ""
    stopped = False
    for c in chunks:
        piece, stopped = m.feed(c)
        out += piece
        # Nothing emitted so far reaches into a stop string that completes later.
        assert expected.startswith(out)
        if stopped:
            break
    if not stopped:
        out += m.flush()
    assert stopped == bool(hits)
    assert out == expected


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60), cuts=st.lists(st.integers(0, 60), max_size=10))
def test_stop_matcher_without_stop_is_identity(text: str, cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    m = StopMatcher(["\x00never\x00"])
    out = "".join(m.feed(text[a:b])[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert out + m.flush() == text
