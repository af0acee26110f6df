"""GGUF files (llama.cpp format): model config from metadata, and dequantised weights by HF name.

The header and key/value section are read by :mod:`pdserve.model.gguf_header` (torch-free, so the
tokenizer can use it); this module adds the tensor table: per tensor a name, uint32 n_dims, n_dims
uint64 sizes (innermost first), uint32 ggml type and uint64 data offset; tensor data starts at the
next multiple of ``general.alignment`` (default 32).

Tensors are memory-mapped and dequantised to float32 with ``gguf.quants.dequantize`` (every ggml
type the ``gguf`` package knows, e.g. Q4_1, Q8_0, K-quants), then renamed to Hugging Face names
through the ``gguf`` package's tensor-name map. llama.cpp's converter reorders the rows of Llama
Q/K projections from the "rotate half" RoPE layout to its interleaved layout;
:func:`unpermute_qk` restores the HF order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pdserve.config import ConfigError, ModelConfig, RopeScaling
from pdserve.model.gguf_header import (  # noqa: F401 - read_gguf_metadata is re-exported
    Scanner,
    read_gguf_metadata,
    scan_metadata,
    with_scanner,
)

# GGUF general.architecture -> (HF architecture, Q/K rows permuted by the converter)
GGUF_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
}

_ROPE_FREQS = "rope_freqs.weight"  # llama3-style per-frequency divisors stored as a tensor


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file. ``shape``: ggml order (innermost first); ``offset``: bytes from
    the start of the tensor data section."""

    name: str
    shape: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    offset: int

    @property
    def nbytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape)) // block * type_size


class GGUFCheckpoint:
    """One GGUF file: its scalar metadata, array lengths and tensor table, scanned once.

    Raises ConfigError when the file is missing, not GGUF v2/v3, truncated, or of an unsupported
    architecture (one line naming it and the supported list).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"GGUF weight file not found: {self.path}")
        self.metadata: dict[str, Any] = {}
        self.array_lengths: dict[str, int] = {}
        self.tensors: dict[str, TensorInfo] = {}
        with_scanner(self.path, self._scan)
        arch = self.metadata.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ConfigError(
                f"GGUF architecture {arch!r} in {self.path.name} is not supported; supported: "
                f"{', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        self.arch: str = arch

    def _scan(self, s: Scanner) -> None:
        n_tensors = scan_metadata(s, self.path, self.metadata, self.array_lengths)
        for _ in range(n_tensors):
            name = s.string()
            shape = tuple(s.fixed("<Q") for _ in range(s.fixed("<I")))
            qtype = gguf.GGMLQuantizationType(s.fixed("<I"))
            self.tensors[name] = TensorInfo(name, shape, qtype, s.fixed("<Q"))
        align = int(self.metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
        self.data_offset = -(-s.off // align) * align
        end = max((t.offset + t.nbytes for t in self.tensors.values()), default=0)
        if self.data_offset + end > len(s.buf):
            raise ConfigError(f"{self.path}: tensor data is truncated")

    def _get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.arch}.{key}", default)

    def _req(self, key: str) -> Any:
        v = self._get(key)
        if v is None:
            raise ConfigError(f"GGUF {self.path.name} is missing metadata key '{self.arch}.{key}'")
        return v

    def model_config(self, model_id: str = "unknown") -> ModelConfig:
        """ModelConfig from metadata only. ``eos_token_ids`` from ``tokenizer.ggml.eos_token_id``;
        tied embeddings when there is no ``output.weight``. Raises ConfigError for a missing
        required key (named) or an unsupported rope scaling type."""
        heads = int(self._req("attention.head_count"))
        hidden = int(self._req("embedding_length"))
        vocab = self._get("vocab_size", self.array_lengths.get("tokenizer.ggml.tokens"))
        if vocab is None:
            raise ConfigError(
                f"GGUF {self.path.name} has neither '{self.arch}.vocab_size' nor a vocabulary"
            )
        scaling = None
        stype = self._get("rope.scaling.type")
        if stype not in (None, "none"):
            if stype != "linear":
                raise ConfigError(
                    f"GGUF rope scaling type {stype!r} is not supported (linear only)"
                )
            scaling = RopeScaling(
                rope_type="linear", factor=float(self._req("rope.scaling.factor"))
            )
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        bos = self.metadata.get("tokenizer.ggml.bos_token_id")
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[self.arch][0],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(self._req("feed_forward_length")),
            num_hidden_layers=int(self._req("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(self._get("attention.head_count_kv", heads)),
            head_dim=int(self._get("attention.key_length", hidden // heads)),
            max_position_embeddings=int(self._get("context_length", 2048)),
            rms_norm_eps=float(self._get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._get("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),),
            model_id=model_id,
        )

    def tensor(self, name: str, data: np.ndarray | None = None) -> torch.Tensor:
        """Tensor ``name`` dequantised (float32; F16 stays float16) in HF (row-major) shape.
        ``data``: the file mapped as uint8 (mapped here when None). Raises KeyError."""
        info = self.tensors[name]
        if data is None:
            data = _map(self.path)
        start = self.data_offset + info.offset
        raw = data[start : start + info.nbytes]
        shape = tuple(reversed(info.shape))  # numpy order: outermost first
        arr: np.ndarray
        if info.qtype == gguf.GGMLQuantizationType.F32:
            arr = raw.view(np.float32).reshape(shape)
        elif info.qtype == gguf.GGMLQuantizationType.F16:
            arr = raw.view(np.float16).reshape(shape)
        else:
            rows = int(np.prod(shape[:-1]))
            arr = gguf.quants.dequantize(raw.reshape(rows, -1), info.qtype).reshape(shape)
        return torch.from_numpy(np.array(arr))  # copy: detach from the mapping

    def weights(self, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, tensor) for every tensor, dequantised, Q/K rows in HF order.

        ``rope_freqs.weight`` is not yielded (see :meth:`rope_freq_factors`). Raises ConfigError
        for a tensor with no HF counterpart.
        """
        permuted = GGUF_ARCHITECTURES[self.arch][1]
        tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH[self.arch.upper()], cfg.num_hidden_layers)
        to_hf: dict[str, str] = {}
        for hf in _hf_names(cfg):
            g = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
            if g is not None:
                to_hf[g] = hf
        data = _map(self.path)
        for name in self.tensors:
            if name == _ROPE_FREQS:
                continue
            hf_name = to_hf.get(name)
            if hf_name is None:
                raise ConfigError(f"GGUF tensor {name!r} has no counterpart in {cfg.architecture}")
            w = self.tensor(name, data)
            if permuted and ".q_proj." in hf_name:
                w = unpermute_qk(w, cfg.num_attention_heads)
            elif permuted and ".k_proj." in hf_name:
                w = unpermute_qk(w, cfg.num_key_value_heads)
            yield hf_name, w

    def rope_freq_factors(self) -> torch.Tensor | None:
        """float32 [head_dim // 2] divisors of the RoPE inverse frequencies (llama.cpp stores
        Llama 3.1-style rope scaling this way), or None when the file has none."""
        if _ROPE_FREQS not in self.tensors:
            return None
        return self.tensor(_ROPE_FREQS).float().reshape(-1)


def _map(path: Path) -> np.ndarray:
    """The file as a read-only uint8 array (a plain ndarray view: np.memmap's per-slice
    bookkeeping would dominate dequantisation time)."""
    return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)


def gguf_model_config(path: str | Path, model_id: str = "unknown") -> ModelConfig:
    """ModelConfig from a GGUF file's metadata (see ``GGUFCheckpoint.model_config``)."""
    return GGUFCheckpoint(path).model_config(model_id)


def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order. w [n_heads * head_dim, ...]: within each head the
    converter interleaved the two rotary halves (rows ``0, d/2, 1, d/2+1, ...``); put them back as
    first half then second half."""
    half = w.shape[0] // n_heads // 2
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
