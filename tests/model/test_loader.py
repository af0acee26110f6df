"""Weight loading: tiny GGUF files (quantised, Q/K permuted) vs transformers, dummy weights,
and one-line errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tiny_models import PagedForward, randomize_
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from pdserve.config import ConfigError, LoadConfig, ModelConfig
from pdserve.model.gguf_file import GGUFCheckpoint, unpermute_qk
from pdserve.model.loader import load_model, load_model_config
from pdserve.model.registry import supported_architectures

pytestmark = pytest.mark.timeout(120)
Q = gguf.GGMLQuantizationType


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama Q/K rows (rotate-half -> interleaved)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_gguf(
    path: Path, arch: str, hf_model: torch.nn.Module, heads: int, kv_heads: int
) -> Path:
    """A GGUF as llama.cpp would write it: matrices Q8_0 (attention) / Q4_1 (MLP), vectors F32,
    F16 embeddings, Q/K rows permuted for 'llama'."""
    cfg = hf_model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(2)
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    for name, t in hf_model.state_dict().items():
        a = t.float().numpy()
        if arch == "llama" and "q_proj" in name:
            a = _llama_cpp_permute(a, heads)
        if arch == "llama" and "k_proj" in name:
            a = _llama_cpp_permute(a, kv_heads)
        gname = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        if "embed_tokens" in name:
            w.add_tensor(gname, a.astype(np.float16))
        elif a.ndim == 2:
            qt = Q.Q4_1 if "mlp" in name else Q.Q8_0
            q = gguf.quants.quantize(a, qt)
            w.add_tensor(gname, q, raw_shape=q.shape, raw_dtype=qt)
        else:
            w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_matches_transformers_gguf_loader(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    base = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
    hf_cfg = LlamaConfig(**base) if arch == "llama" else Qwen2Config(**base)
    src = AutoModelForCausalLM.from_config(hf_cfg).eval()
    randomize_(src)
    path = _write_gguf(tmp_path / f"tiny-{arch}.gguf", arch, src, 4, 2)

    cfg = load_model_config(LoadConfig(model=str(path)))
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert cfg.eos_token_ids == (2,) and cfg.attention_bias == (arch == "qwen2")
    assert not cfg.tie_word_embeddings

    ours = load_model(LoadConfig(model=str(path), dtype="float32"))
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    # same dequantised weights as transformers' own GGUF reader (incl. its Q/K un-permutation)
    qkv = ours.state_dict()["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[:64], ref.state_dict()["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(qkv[64:96], ref.state_dict()["model.layers.1.self_attn.k_proj.weight"])
    # and close to the unquantised source (Q8_0 error is small)
    q_src = src.state_dict()["model.layers.1.self_attn.q_proj.weight"]
    assert (qkv[:64] - q_src).abs().max().item() < 0.01

    tokens = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ref(tokens[None]).logits[0]
    got = PagedForward(ours)([tokens.tolist()], [0], [list(range(8))])[0]
    assert (got - expected).abs().max().item() < 1e-4


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    w = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    permuted = torch.from_numpy(_llama_cpp_permute(w.numpy(), 8))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_qk(permuted, 8), w)


def test_dummy_weights_for_any_config() -> None:
    cfg = ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=50, hidden_size=32, intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=64, attention_bias=True,
    )  # fmt: skip
    load = LoadConfig(model="unused", load_format="dummy", dtype="bfloat16", seed=5)
    a, b = load_model(load, cfg), load_model(load, cfg)
    assert next(a.parameters()).dtype == torch.bfloat16
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb) and pa.float().std() > 0
    out = PagedForward(a)([[1, 2, 3, 4, 5]], [0], [[0, 1]])[0]
    assert out.shape == (5, 50) and torch.isfinite(out).all()


def _one_line(e: pytest.ExceptionInfo[ConfigError]) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def test_unsupported_architecture(tmp_path: Path) -> None:
    cfg = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 10, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        load_model_config(LoadConfig(model=str(tmp_path)))
    msg = _one_line(e)
    assert "'GPT2LMHeadModel' is not supported" in msg
    for arch in supported_architectures():
        assert arch in msg


def test_missing_weight_file(tmp_path: Path) -> None:
    hf = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                     num_attention_heads=2, architectures=["LlamaForCausalLM"])  # fmt: skip
    hf.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as e:
        load_model(LoadConfig(model=str(tmp_path)))
    assert "no weight files (*.safetensors) in" in _one_line(e)
    with pytest.raises(ConfigError):
        load_model_config(LoadConfig(model=str(tmp_path)))
    # a config alone is enough for dummy weights
    assert load_model_config(LoadConfig(model=str(tmp_path), load_format="dummy")).vocab_size == 16
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ConfigError) as e:
        load_model(LoadConfig(model=str(tmp_path)))
    assert "model-00001-of-00002.safetensors listed in model.safetensors.index.json is missing" in (
        _one_line(e)
    )
    with pytest.raises(ConfigError) as e:
        load_model(LoadConfig(model=str(tmp_path / "nope.gguf")))
    assert "not found" in _one_line(e)


def test_gguf_of_unknown_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError) as e:
        load_model_config(LoadConfig(model=str(path)))
    msg = _one_line(e)
    assert "GGUF architecture 'mamba' in mamba.gguf is not supported" in msg and "llama" in msg
    with pytest.raises(ConfigError):
        GGUFCheckpoint(path)
    path.write_bytes(b"GGUF\x07\x00\x00\x00" + b"\x00" * 16)
    with pytest.raises(ConfigError) as e:
        load_model(LoadConfig(model=str(path)))
    assert "GGUF version 7 is not supported" in _one_line(e)
