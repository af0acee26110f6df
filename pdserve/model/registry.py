"""Architecture registry: Hugging Face architecture name -> model class (STYLE 8).

Model modules register their classes with :func:`register_model`; :func:`get_model_class` imports
them on first use, so the registry is complete without callers importing model files.
"""

from __future__ import annotations

import importlib
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
from torch import nn

from pdserve.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from pdserve.attention.base import AttentionBackend, AttentionMetadata


class CausalLM(nn.Module):
    """What the loader and the runner need from a registered model class.

    ``packed_modules_mapping``: checkpoint projection name -> (fused module name, shard index),
    e.g. ``{"q_proj": ("qkv_proj", 0)}``. ``lm_head``: the output projection hidden -> vocab, or
    None when the logits come from the input embedding matrix (tied weights).
    """

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}
    config: ModelConfig
    lm_head: nn.Module | None
    attn_backend: AttentionBackend  # builds the per-step AttentionMetadata its layers read

    @abstractmethod
    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Flat packed tokens -> final hidden states [num_tokens, hidden]."""

    @abstractmethod
    def decoder(self) -> nn.Module:
        """The part of :meth:`forward` that :func:`pdserve.model.compile.compile_model` compiles:
        a module whose tensor arguments and result all have the step's token count as their first
        dimension, and that reaches attention only through
        :func:`pdserve.model.paged_attention.paged_attention` (no per-step metadata, no host-side
        work). ``forward`` must call it as ``self.decoder()(...)``."""

    @abstractmethod
    def input_embeddings(self) -> nn.Embedding:
        """The token embedding table [vocab, hidden]."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab]."""

    def set_rope_freq_factors(self, factors: torch.Tensor) -> None:
        """Divide the RoPE inverse frequencies by ``factors`` [head_dim // 2] (GGUF rope_freqs)."""
        raise NotImplementedError(f"{type(self).__name__} does not take rope frequency factors")


_MODEL_MODULES = ("pdserve.model.llama",)
_REGISTRY: dict[str, type[CausalLM]] = {}

M = TypeVar("M", bound=type[CausalLM])


def register_model(*architectures: str) -> Callable[[M], M]:
    """Class decorator: serve each HF architecture name (e.g. 'LlamaForCausalLM') with the class."""

    def deco(cls: M) -> M:
        for name in architectures:
            _REGISTRY[name] = cls
        return cls

    return deco


def _load_all() -> None:
    for module in _MODEL_MODULES:
        importlib.import_module(module)


def supported_architectures() -> list[str]:
    """Sorted HF architecture names that have an implementation."""
    _load_all()
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type[CausalLM]:
    """The class implementing ``architecture``. Raises ConfigError naming the supported list."""
    _load_all()
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ConfigError(
            f"model architecture {architecture!r} is not supported; supported: "
            f"{', '.join(sorted(_REGISTRY))}"
        ) from None
