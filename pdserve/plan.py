"""KV cache capacity planner (`pdserve plan`).

Sizes the paged KV cache of any decoder-only model from its Hugging Face ``config.json`` with the
seed formula (DESIGN §3):

    kv_bytes = 2 * num_layers * num_kv_heads * head_dim * bytes_per_elem * tokens   (* batch)

where 2 counts keys and values. Given a memory budget it also reports how many sequences of that
length fit at once, counting whole KV blocks the way the block pool allocates them (a sequence of
``tokens`` tokens holds ``ceil(tokens / block_size)`` blocks).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import ConfigError, ModelConfig, dtype_bytes
from pdserve.model.resolve import SMOLLM2_NAMES

GIB = 1024**3
# Common short names accepted by --dtype, mapped to the names pdserve.config knows.
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class KVPlan:
    """KV cache sizing of one model for ``batch`` sequences of ``tokens`` tokens each.

    All sizes are in bytes. ``max_concurrency`` (sequences of ``tokens`` tokens admitted at once)
    and ``num_blocks`` are set only when a memory budget was given.
    """

    model: ModelConfig
    dtype: str
    tokens: int
    batch: int
    block_size: int
    bytes_per_token: int
    total_bytes: int
    memory_bytes: int | None = None
    num_blocks: int | None = None
    max_concurrency: int | None = None


def load_model_config(path: str | Path) -> ModelConfig:
    """Read a model's configuration for planning: a HF ``config.json`` (file or directory holding
    one), a ``.gguf`` file's metadata, or ``smollm2`` (the bundled model), as ``--model`` takes.

    Raises ConfigError with one line naming the file and the problem (missing file, bad JSON,
    not a JSON object, missing key, non-numeric value).
    """
    name = str(path)
    if name.lower() in SMOLLM2_NAMES or name.endswith(".gguf"):
        return _model_config(name)
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(
            f"--config: file not found: {p} (give a config.json, its directory, a .gguf file "
            "or smollm2)"
        )
    try:
        raw = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config: cannot read {p}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"--config: {p} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config: {p} must hold a JSON object, got {type(raw).__name__}")
    try:
        return ModelConfig.from_hf_dict(raw, model_id=p.parent.name or "unknown")
    except ConfigError as e:
        raise ConfigError(f"--config {p}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--config {p}: a numeric field has a bad value ({e})") from None


def _model_config(model: str) -> ModelConfig:
    """The config of a ``--model`` argument that is no config.json (imports the model loader,
    and so torch, only then). Raises ConfigError."""
    from pdserve.config import LoadConfig
    from pdserve.model.loader import load_model_config as model_config

    try:
        return model_config(LoadConfig(model=model, load_format="dummy"))
    except ConfigError as e:
        raise ConfigError(f"--config: {e}") from None


def plan_kv(
    model: ModelConfig,
    tokens: int,
    batch: int = 1,
    dtype: str = "bfloat16",
    memory_gib: float | None = None,
    block_size: int = 16,
) -> KVPlan:
    """Size the KV cache for ``batch`` sequences of ``tokens`` tokens in ``dtype``.

    ``memory_gib``: KV cache budget in GiB (2**30 bytes); when given, the plan says how many
    sequences of ``tokens`` tokens fit, in whole blocks of ``block_size`` tokens.
    Raises ConfigError naming the argument when a value is out of range.
    """
    if tokens <= 0:
        raise ConfigError(f"--tokens must be > 0, got {tokens}")
    if batch <= 0:
        raise ConfigError(f"--batch must be > 0, got {batch}")
    if block_size <= 0:
        raise ConfigError(f"--block-size must be > 0, got {block_size}")
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    try:
        elem_bytes = dtype_bytes(dtype)
    except ConfigError as e:
        raise ConfigError(f"--dtype: {e}") from None
    per_token = model.kv_bytes_per_token * elem_bytes
    plan = KVPlan(
        model=model,
        dtype=dtype,
        tokens=tokens,
        batch=batch,
        block_size=block_size,
        bytes_per_token=per_token,
        total_bytes=per_token * tokens * batch,
    )
    if memory_gib is None:
        return plan
    if not memory_gib > 0:
        raise ConfigError(f"--memory-gib must be > 0, got {memory_gib}")
    memory_bytes = int(memory_gib * GIB)
    num_blocks = memory_bytes // (per_token * block_size)
    blocks_per_seq = math.ceil(tokens / block_size)
    return KVPlan(
        **{
            **plan.__dict__,
            "memory_bytes": memory_bytes,
            "num_blocks": num_blocks,
            "max_concurrency": num_blocks // blocks_per_seq,
        }
    )


def format_bytes(n: int) -> str:
    """``15032385536`` -> ``'15,032,385,536 bytes (14.0 GiB)'``."""
    return f"{n:,} bytes ({n / GIB:.1f} GiB)"


def format_plan(plan: KVPlan) -> str:
    """Human-readable multi-line report of a plan (thousands separators and GiB)."""
    m = plan.model
    lines = [
        f"model: {m.architecture} ({m.num_hidden_layers} layers, {m.num_key_value_heads} KV heads, "
        f"head_dim {m.head_dim})",
        f"KV cache per token ({plan.dtype}): {plan.bytes_per_token:,} bytes",
        f"KV cache for {plan.batch} x {plan.tokens:,} tokens: {format_bytes(plan.total_bytes)}",
    ]
    if plan.memory_bytes is not None:
        lines.append(
            f"{format_bytes(plan.memory_bytes)} of KV memory holds {plan.num_blocks:,} blocks of "
            f"{plan.block_size} tokens: admits {plan.max_concurrency:,} concurrent sequences of "
            f"{plan.tokens:,} tokens"
        )
    if plan.tokens > m.max_position_embeddings:
        lines.append(
            f"note: {plan.tokens:,} tokens is past the model's context length "
            f"({m.max_position_embeddings:,} tokens, max_position_embeddings): pdserve serve "
            "refuses a --max-model-len above it"
        )
    return "\n".join(lines)
