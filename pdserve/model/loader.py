"""Model config and weights from a Hugging Face directory, a GGUF file, or random ('dummy').

* HF directory: ``config.json`` + one ``model.safetensors`` or shards listed in
  ``model.safetensors.index.json`` (read with the ``safetensors`` library, one tensor at a time).
* GGUF: metadata -> config, tensors dequantised (``pdserve.model.gguf_file``).
* dummy: random weights for any config, seeded by ``LoadConfig.seed`` (performance work and tests).

Checkpoints store q/k/v and gate/up apart; the model fuses them (``packed_modules_mapping``), so
each tensor is copied into its rows of the fused parameter. Every parameter must be filled once.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.attention.base import AttentionBackend, get_backend
from pdserve.attention.selector import select_attention_backend
from pdserve.config import ConfigError, LoadConfig, ModelConfig
from pdserve.model import gguf_file
from pdserve.model.layers import MergedLinear
from pdserve.model.registry import CausalLM, get_model_class
from pdserve.model.resolve import ResolvedModel, resolve_model

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# checkpoint entries that are not parameters (recomputed at run time)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def torch_dtype(name: str) -> torch.dtype:
    """'float32' | 'bfloat16' | 'float16' -> torch dtype. Raises ConfigError."""
    try:
        return _TORCH_DTYPES[name]
    except KeyError:
        raise ConfigError(
            f"dtype {name!r} is not supported; choose one of {sorted(_TORCH_DTYPES)}"
        ) from None


def _hf_config_dict(path: Path) -> dict[str, Any]:
    """Parsed config.json, with transformers >= 5's ``rope_parameters`` lifted into the classic
    ``rope_theta`` / ``rope_scaling`` keys that ModelConfig reads."""
    try:
        cfg: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict):
        if "rope_theta" not in cfg and "rope_theta" in rp:
            cfg["rope_theta"] = rp["rope_theta"]
        if not cfg.get("rope_scaling") and rp.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
    return cfg


def _config_of(
    resolved: ResolvedModel, ckpt: gguf_file.GGUFCheckpoint | None = None
) -> ModelConfig:
    if resolved.kind == "gguf":
        ckpt = ckpt or gguf_file.GGUFCheckpoint(resolved.path)
        cfg = ckpt.model_config(model_id=resolved.name)
    else:
        raw = _hf_config_dict(resolved.path / "config.json")
        cfg = ModelConfig.from_hf_dict(raw, model_id=resolved.name)
    get_model_class(cfg.architecture)  # fail early, one line, on an unsupported architecture
    return cfg


def load_model_config(load: LoadConfig) -> ModelConfig:
    """The ModelConfig of ``load.model`` without reading any tensor (config.json or GGUF
    metadata). Unless ``load_format`` is 'dummy', also checks that the weight files exist.
    Raises ConfigError (model or weight file not found, unsupported architecture, bad config)."""
    resolved = resolve_model(load.model)
    cfg = _config_of(resolved)
    if load.load_format != "dummy" and resolved.kind == "hf":
        safetensors_files(resolved.path)
    return cfg


def safetensors_files(model_dir: Path) -> list[Path]:
    """Weight files of a HF directory: the shards named by ``model.safetensors.index.json``, else
    every ``*.safetensors``. Raises ConfigError when none exist or a listed shard is missing."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ConfigError(f"{index} is not a valid safetensors index: {e}") from None
        files = [model_dir / s for s in shards]
        for f in files:
            if not f.is_file():
                raise ConfigError(f"weight file {f} listed in {index.name} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no weight files (*.safetensors) in {model_dir}")
    return files


def safetensors_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every weight file of a HF directory, one tensor at a time."""
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, sf.get_tensor(name)


def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy checkpoint tensors (HF names) into ``model``'s parameters, casting to their dtype.

    Raises ConfigError naming an unexpected tensor, a shape mismatch, or the parameters that no
    tensor filled.
    """
    params = dict(model.named_parameters())
    mapping = model.packed_modules_mapping
    tied = model.config.tie_word_embeddings
    filled: dict[str, int] = {}  # param name -> rows filled
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target, rows = name, None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in mapping:
            packed, shard = mapping[parts[-2]]
            target = ".".join([*parts[:-2], packed, parts[-1]])
            module = model.get_submodule(".".join([*parts[:-2], packed]))
            if not isinstance(module, MergedLinear):
                raise ConfigError(f"weight {name!r}: {target} is not a merged projection")
            rows = module.shard_offset(shard)
        param = params.get(target)
        if param is None:
            raise ConfigError(f"unexpected weight {name!r} for {type(model).__name__}")
        dest = param.data if rows is None else param.data[rows[0] : rows[0] + rows[1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ConfigError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        filled[target] = filled.get(target, 0) + dest.shape[0]
    missing = [n for n, p in params.items() if filled.get(n, 0) != p.shape[0]]
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConfigError(f"checkpoint is missing weights: {', '.join(missing[:3])}{more}")


def init_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter with seeded random values: N(0, 0.02) for matrices and biases,
    1 + N(0, 0.02) for norm scales (a usable, non-degenerate network of any shape)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32) * 0.02
        if name.endswith("norm.weight"):
            noise += 1.0
        p.data.copy_(noise)


def load_model(
    load: LoadConfig,
    model_config: ModelConfig | None = None,
    backend: AttentionBackend | None = None,
) -> CausalLM:
    """Build the model for ``load`` in ``load.resolved_dtype`` on ``load.device`` and fill its
    weights (from the checkpoint, or random for ``load_format='dummy'``).

    ``model_config`` is required when there is no checkpoint config to read (dummy weights of a
    config built in code). Raises ConfigError (missing files, unsupported architecture, weight
    mismatch, or an ``attention_backend`` that cannot run here). ``backend`` None = the one
    :func:`~pdserve.attention.selector.select_attention_backend` picks for ``load``.
    """
    resolved, ckpt = None, None
    if load.load_format != "dummy" or model_config is None:
        resolved = resolve_model(load.model)
        if resolved.kind == "gguf":
            ckpt = gguf_file.GGUFCheckpoint(resolved.path)
    if model_config is not None:
        cfg = model_config
    else:
        assert resolved is not None
        cfg = _config_of(resolved, ckpt)
    cls = get_model_class(cfg.architecture)
    if backend is None:
        name = select_attention_backend(load.attention_backend, load.device, cfg.head_dim)
        backend = get_backend(name)
    dtype = torch_dtype(load.resolved_dtype)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are created in the target dtype
    try:
        with torch.device("meta"):
            model = cls(cfg, backend=backend)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=load.device)
    if load.load_format == "dummy":
        init_dummy_weights(model, load.seed)
    else:
        assert resolved is not None
        fmt = (
            load.load_format
            if load.load_format != "auto"
            else ("gguf" if resolved.kind == "gguf" else "safetensors")
        )
        if fmt == "gguf":
            if ckpt is None:
                raise ConfigError(f"--load-format gguf needs a .gguf file, got {resolved.path}")
            load_weights(model, ckpt.weights(cfg))
            factors = ckpt.rope_freq_factors()
            if factors is not None:
                model.set_rope_freq_factors(factors)
        else:
            if resolved.kind != "hf":
                raise ConfigError(
                    f"--load-format safetensors needs a Hugging Face directory, got {resolved.path}"
                )
            load_weights(model, safetensors_weights(resolved.path))
    model.eval()
    model.requires_grad_(False)
    return model
