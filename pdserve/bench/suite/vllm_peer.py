"""The vLLM peer: a script outside the repository that serves vLLM's CPU build on the same
SmolLM2 weights and runs vLLM's own ``vllm bench serve`` client.

The script (``--vllm-peer``, default ``../shared/peers/vllm-cpu.sh`` from the repository root)
answers ``serve PORT DTYPE`` (foreground OpenAI server on 127.0.0.1:PORT, model id ``smollm2``;
it compiles for 2-4 minutes before ``/health`` answers), ``bench ARGS...`` (vLLM's client) and
``hf`` (prints the Hugging Face copy of the weights, the tokenizer vLLM's client needs).
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.suite.servers import ServerSpec, free_port
from pdserve.bench.suite.workloads import MainWorkload, main_flags

PEER_ENV = "PDSERVE_VLLM_PEER"
DEFAULT_PEER = Path("..") / "shared" / "peers" / "vllm-cpu.sh"
PEER_MODEL = "smollm2"  # the script's --served-model-name


class PeerError(RuntimeError):
    """The peer script is missing or one of its commands failed (one-line message)."""


@dataclass(frozen=True)
class VllmPeer:
    """The peer script at ``script`` (an existing executable file)."""

    script: Path

    @classmethod
    def locate(cls, path: str | None, repo_root: Path) -> VllmPeer:
        """The script at ``path`` (relative paths from ``repo_root``), else ``$PDSERVE_VLLM_PEER``,
        else the default. Raises PeerError naming the path when it is not an executable file."""
        raw = path or os.environ.get(PEER_ENV) or str(DEFAULT_PEER)
        script = Path(raw).expanduser()
        if not script.is_absolute():
            script = repo_root / script
        script = script.resolve()
        if not script.is_file() or not os.access(script, os.X_OK):
            raise PeerError(
                f"vLLM peer script not found or not executable: {script} "
                f"(pass --vllm-peer PATH or set {PEER_ENV})"
            )
        return cls(script)

    def serve_spec(self, dtype: str) -> ServerSpec:
        """``SCRIPT serve PORT DTYPE`` on a free port; ready when ``/health`` answers 200."""
        port = free_port()
        return ServerSpec("vllm", (str(self.script), "serve", str(port), dtype), port)

    def hf_dir(self) -> str:
        """The Hugging Face copy of the weights (``SCRIPT hf``). Raises PeerError."""
        try:
            out = subprocess.run(
                [str(self.script), "hf"], capture_output=True, text=True, timeout=60, check=True
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise PeerError(f"{self.script} hf failed: {e}") from e
        return out.stdout.strip()

    def bench_argv(
        self, base_url: str, model: str, workload: MainWorkload, seed: int, label: str,
        result_path: Path,
    ) -> list[str]:  # fmt: skip
        """vLLM's client command for the main workload: the flags our client takes too
        (:func:`pdserve.bench.suite.workloads.main_flags`), plus its backend, the HF tokenizer,
        and ``--save-detailed`` so the file holds per-request arrays for ``pdserve bench plot``.
        Raises PeerError when the script cannot name its tokenizer."""
        chat = workload.endpoint.endswith("chat/completions")
        return [
            str(self.script), "bench", "--backend", "openai-chat" if chat else "openai",
            "--base-url", base_url, "--model", model, "--tokenizer", self.hf_dir(),
            *main_flags(workload, seed), "--label", label, "--disable-tqdm",
            "--save-result", "--save-detailed",
            "--result-dir", str(result_path.parent), "--result-filename", result_path.name,
        ]  # fmt: skip

    def run_bench(
        self, argv: list[str], result_path: Path, log_path: Path, timeout_s: float
    ) -> dict[str, Any]:
        """Run a :meth:`bench_argv` command; returns the result JSON it wrote. Raises PeerError
        (non-zero exit, timeout, no file), naming the log."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            try:
                rc = subprocess.run(
                    argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
                ).returncode
            except subprocess.TimeoutExpired:
                raise PeerError(
                    f"vLLM's bench client ran past {timeout_s:.0f} s (log {log_path})"
                ) from None
            except OSError as e:
                raise PeerError(f"cannot run {self.script} bench: {e}") from e
        if rc != 0 or not result_path.is_file():
            raise PeerError(f"vLLM's bench client exited with {rc} (log {log_path})")
        doc: dict[str, Any] = json.loads(result_path.read_text())
        return doc
