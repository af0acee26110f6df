"""`pdserve generate`: the bundled model answers, and bad input gives one clear line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cli import main


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_chat_answers_paris() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # see tests/engine/test_smollm2.py::one_thread
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--chat", "--prompt",
         "What is the capital of France?"],
        capture_output=True, text=True, timeout=280, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "1 prompts" in proc.stderr and "tok/s" in proc.stderr


@pytest.mark.timeout(60)
def test_unsupported_architecture_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cfg = {"architectures": ["MambaForCausalLM"], "vocab_size": 10, "hidden_size": 8,
           "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = main(["generate", "--model", str(tmp_path), "--prompt", "hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err
    assert "'MambaForCausalLM' is not supported; supported: LlamaForCausalLM" in err


@pytest.mark.timeout(60)
def test_bad_sampling_value_one_line(capsys: pytest.CaptureFixture) -> None:
    rc = main(["generate", "--prompt", "hi", "--temperature", "-1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "'temperature' must be in [0, 2]" in err


@pytest.mark.timeout(60)
def test_kernel_builds_are_announced(capsys: pytest.CaptureFixture) -> None:
    """New-user (session 40): a first run spent ~40 s compiling the CPU kernels in silence."""
    import logging

    from pdserve.commands.generate import show_kernel_builds

    build_log = logging.getLogger("pdserve.attention.cpu_build")
    before = list(build_log.handlers)
    try:
        show_kernel_builds()
        show_kernel_builds()  # once is enough
        build_log.info("compiling paged_decode.c for this CPU (first use; cached in /c)")
        err = capsys.readouterr().err
        assert err == "[pdserve] compiling paged_decode.c for this CPU (first use; cached in /c)\n"
    finally:
        for h in build_log.handlers[len(before) :]:
            build_log.removeHandler(h)
        build_log.setLevel(logging.NOTSET)
