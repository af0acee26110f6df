"""GGUF files (llama.cpp format): model config from metadata, and dequantised weights by HF name.

Metadata keys follow the GGUF spec (``{arch}.block_count``, ``{arch}.embedding_length``, ...,
``tokenizer.ggml.eos_token_id``). Tensors of any quantisation type are dequantised to float32 with
``gguf.quants.dequantize`` and renamed to Hugging Face names through the ``gguf`` package's own
tensor-name map. llama.cpp's converter reorders the rows of Llama Q/K projections from the
"rotate half" RoPE layout to its interleaved layout; :func:`unpermute_qk` restores the HF order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pdserve.config import ConfigError, ModelConfig, RopeScaling

# GGUF general.architecture -> (HF architecture, Q/K rows permuted by the converter)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

_ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-frequency divisors stored as a tensor


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Memory-map a GGUF file (no tensor data is read). Raises ConfigError if unreadable."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"GGUF weight file not found: {p}")
    try:
        return gguf.GGUFReader(p)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{p} is not a readable GGUF file: {e}") from None


def _get(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _arch(reader: gguf.GGUFReader, path: str | Path) -> str:
    arch = _get(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"GGUF architecture {arch!r} in {Path(path).name} is not supported; supported: "
            f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
        )
    return str(arch)


class GGUFCheckpoint:
    """One opened GGUF file (parsing its metadata takes seconds, so open it once).

    Raises ConfigError when the file is missing, unreadable, or of an unsupported architecture.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        self.arch = _arch(self.reader, self.path)

    def model_config(self, model_id: str = "unknown") -> ModelConfig:
        """ModelConfig from metadata only (see :func:`gguf_model_config`)."""
        return _model_config(self.reader, self.arch, self.path, model_id)

    def weights(self, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) pairs (see :func:`_weights`)."""
        return _weights(self.reader, self.arch, cfg)

    def rope_freq_factors(self) -> torch.Tensor | None:
        """float32 [head_dim // 2] divisors of the RoPE inverse frequencies (llama.cpp stores
        Llama 3.1-style rope scaling this way), or None when the file has none."""
        for t in self.reader.tensors:
            if t.name == _ROPE_FREQS:
                return _to_torch(t).float().reshape(-1)
        return None


def gguf_model_config(path: str | Path, model_id: str = "unknown") -> ModelConfig:
    """ModelConfig from GGUF metadata only. Raises ConfigError for a missing file, an unsupported
    architecture or rope scaling type, or a missing required key (named)."""
    return GGUFCheckpoint(path).model_config(model_id)


def _model_config(reader: gguf.GGUFReader, arch: str, path: Path, model_id: str) -> ModelConfig:
    hf_arch = GGUF_ARCHITECTURES[arch][0]

    def req(key: str) -> Any:
        v = _get(reader, f"{arch}.{key}")
        if v is None:
            raise ConfigError(f"GGUF {Path(path).name} is missing metadata key '{arch}.{key}'")
        return v

    names = {t.name for t in reader.tensors}
    heads = int(req("attention.head_count"))
    hidden = int(req("embedding_length"))
    vocab = _get(reader, f"{arch}.vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else None
    if vocab is None:
        raise ConfigError(
            f"GGUF {Path(path).name} has neither '{arch}.vocab_size' nor a vocabulary"
        )
    scaling = None
    stype = _get(reader, f"{arch}.rope.scaling.type")
    if stype not in (None, "none"):
        if stype != "linear":
            raise ConfigError(f"GGUF rope scaling type {stype!r} is not supported (linear only)")
        scaling = RopeScaling(rope_type="linear", factor=float(req("rope.scaling.factor")))
    eos = _get(reader, "tokenizer.ggml.eos_token_id")
    bos = _get(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=hf_arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(req("feed_forward_length")),
        num_hidden_layers=int(req("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_get(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_get(reader, f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(_get(reader, f"{arch}.context_length", 2048)),
        rms_norm_eps=float(_get(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_get(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        model_id=model_id,
    )


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order. w [n_heads * head_dim, ...]: within each head the
    converter interleaved the two rotary halves (rows ``0, d/2, 1, d/2+1, ...``); put them back as
    first half then second half."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _hf_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for sub in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names += [f"{p}self_attn.{sub}.weight", f"{p}self_attn.{sub}.bias"]
        for sub in ("gate_proj", "up_proj", "down_proj"):
            names.append(f"{p}mlp.{sub}.weight")
        names += [f"{p}input_layernorm.weight", f"{p}post_attention_layernorm.weight"]
    return names


def _to_torch(t: Any) -> torch.Tensor:
    """A GGUF ReaderTensor -> float32/float16 torch tensor in HF (numpy) shape order."""
    shape = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        arr = np.array(t.data)
    else:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(arr.reshape(shape))


def _weights(
    reader: gguf.GGUFReader, arch: str, cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) for every GGUF tensor, dequantised, Q/K rows in HF order.

    ``rope_freqs.weight`` is not yielded (see ``GGUFCheckpoint.rope_freq_factors``). Raises
    ConfigError for a tensor with no HF counterpart.
    """
    permuted = GGUF_ARCHITECTURES[arch][1]
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    to_hf: dict[str, str] = {}
    for hf in _hf_names(cfg):
        g = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if g is not None:
            to_hf[g] = hf
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        hf_name = to_hf.get(t.name)
        if hf_name is None:
            raise ConfigError(f"GGUF tensor {t.name!r} has no counterpart in {cfg.architecture}")
        w = _to_torch(t)
        if permuted and ".q_proj." in hf_name:
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif permuted and ".k_proj." in hf_name:
            w = unpermute_qk(w, cfg.num_key_value_heads)
        yield hf_name, w
