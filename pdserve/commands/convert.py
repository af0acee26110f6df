"""`pdserve convert`: write a model's weights as a Hugging Face directory.

Other servers (vLLM, transformers, llama.cpp's HF importers) then load exactly the weights pdserve
serves, so benchmarks compare engines rather than checkpoints. For a GGUF (``--model smollm2``)
transformers dequantises the tensors (undoing GGUF's Q/K row permutation) and the result is saved
as ``model.safetensors`` + ``config.json`` + ``generation_config.json`` + the tokenizer files
(with the chat template pdserve uses). ``config.json`` is then made loadable by older readers
too: the ``quantization_config`` that transformers attaches to GGUF loads is removed (the saved
weights are plain floats), and ``rope_theta`` / ``torch_dtype`` are written at the top level
beside transformers 5's ``rope_parameters`` / ``dtype``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.config import ConfigError

DTYPES = ("float32", "bfloat16", "float16")


def register(subparsers: Any) -> None:
    """Add the ``convert`` subcommand."""
    p = subparsers.add_parser(
        "convert",
        help="write the weights as a Hugging Face directory",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a HF directory")
    p.add_argument("--output", required=True, help="directory to create")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=DTYPES,
        help="dtype of the saved weights (default float32: dequantised GGUF values are exact)",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty --output directory")
    p.set_defaults(func=run)


@dataclass
class Converted:
    """A finished conversion: the directory, its files and the in-memory transformers model."""

    output: Path
    files: list[str]
    model: Any  # transformers PreTrainedModel as loaded from the source (e.g. the GGUF)


def fix_config(path: Path) -> dict[str, Any]:
    """Make a saved ``config.json`` plain: no quantization_config; rope_theta / torch_dtype at the
    top level when only transformers 5's nested/renamed keys hold them. Returns the new dict."""
    cfg = json.loads(path.read_text())
    cfg.pop("quantization_config", None)
    rope = cfg.get("rope_parameters")
    if "rope_theta" not in cfg and isinstance(rope, dict) and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    if "torch_dtype" not in cfg and "dtype" in cfg:
        cfg["torch_dtype"] = cfg["dtype"]
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return cfg


def _inline_chat_template(output: Path) -> None:
    """Copy ``chat_template.jinja`` into ``tokenizer_config.json`` too: transformers before 4.49
    (and tools built on it) only read the template from there."""
    template, tok_cfg = output / "chat_template.jinja", output / "tokenizer_config.json"
    if not (template.is_file() and tok_cfg.is_file()):
        return
    cfg = json.loads(tok_cfg.read_text())
    cfg.setdefault("chat_template", template.read_text())
    tok_cfg.write_text(json.dumps(cfg, indent=2) + "\n")


def convert(model: str, output: Path, dtype: str = "float32", force: bool = False) -> Converted:
    """Load ``model`` with transformers and save it as a HF directory at ``output``.

    Raises ConfigError for an unknown model, a bad dtype or a non-empty output directory
    (unless ``force``).
    """
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.model.resolve import resolve_model
    from pdserve.tokenizer import load_tokenizer

    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    src = resolve_model(model)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        if not force:
            raise ConfigError(f"--output {output} exists and is not empty (use --force to replace)")
        shutil.rmtree(output) if output.is_dir() else output.unlink()
    torch_dtype = getattr(torch, dtype)
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "local_files_only": True}
    if src.kind == "gguf":
        kwargs["gguf_file"] = src.path.name
    loaded = AutoModelForCausalLM.from_pretrained(str(src.hf_dir), **kwargs)
    # transformers refuses to save a GGUF-loaded model (it counts as quantised even though the
    # tensors are dequantised floats): share its tensors with a plain model of the same config,
    # built on the meta device (no second copy), used only for saving. NOTE: its non-persistent
    # buffers (RoPE inv_freq) stay on meta, so it cannot run; callers get ``loaded``.
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    plain_cfg = type(loaded.config).from_dict(cfg_dict)
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(plain_cfg, dtype=torch_dtype)
    hf_model.load_state_dict(loaded.state_dict(), assign=True)
    hf_model.tie_weights()
    hf_model.generation_config = loaded.generation_config
    loaded.eval()
    tokenizer = load_tokenizer(model)
    eos = list(tokenizer.eos_token_ids)
    if eos:
        # (one object, shared by both models)
        hf_model.generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos
    output.mkdir(parents=True, exist_ok=True)
    hf_model.save_pretrained(str(output), safe_serialization=True)
    tokenizer.hf.save_pretrained(str(output))
    fix_config(output / "config.json")
    _inline_chat_template(output)
    _default_modes(output)
    return Converted(output, sorted(p.name for p in output.iterdir()), loaded)


def _default_modes(output: Path) -> None:
    """Give every written file the mode a new file gets under the umask (0644 under 022): the
    weights file is written through a private temporary file (0600), which would keep other
    users, and a server running as another user, from reading it."""
    umask = os.umask(0)
    os.umask(umask)
    for f in output.iterdir():
        if f.is_file():
            f.chmod(0o666 & ~umask)


def run(args: argparse.Namespace) -> int:
    """Convert; print the directory and its files. One-line error and status 2 on bad input."""
    try:
        result = convert(args.model, Path(args.output), args.dtype, args.force)
    except ConfigError as e:
        print(f"pdserve convert: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {result.output}: {', '.join(result.files)}")
    return 0
