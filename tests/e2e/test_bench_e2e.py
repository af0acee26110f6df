"""`pdserve bench serve` against a real `pdserve serve` on SmolLM2: 20 requests, valid JSON."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.bench.report import load_result
from pdserve.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]
STARTUP_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server (it stops gateways, workers and Ray), then SIGKILL its group."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test created for the server
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port, grpc_port = _free_port(), _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "serve", "--model", "smollm2", "--enforce-eager",
             "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port)],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(
                    f"pdserve serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"pdserve serve not up after {STARTUP_TIMEOUT_S:.0f} s:\n"
                            f"{log.read_text()[-3000:]}")  # fmt: skip
            time.sleep(1.0)
        yield url
    finally:
        _stop(proc)


def test_bench_20_requests_json_validates(server_url: str, tmp_path: Path) -> None:
    rc = main([
        "bench", "serve", "--base-url", server_url, "--tokenizer", "smollm2",
        "--endpoint", "/v1/chat/completions", "--dataset-name", "random", "--num-prompts", "20",
        "--random-input-len", "48", "--random-output-len", "16", "--ignore-eos",
        "--max-concurrency", "4", "--ready-timeout", "120", "--goodput", "ttft:60000",
        "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
        "--result-filename", "pdserve.json",
    ])  # fmt: skip
    assert rc == 0
    doc = load_result(tmp_path / "pdserve.json")  # validates the schema
    assert doc["completed"] == 20 and doc["failed"] == 0, doc["errors"]
    assert doc["output_lens"] == [16] * 20  # ignore_eos: exactly max_tokens, counted by usage
    assert all(n >= 48 for n in doc["input_lens"])  # usage.prompt_tokens incl. chat template
    assert doc["mean_ttft_ms"] > 0 and doc["mean_tpot_ms"] > 0 and doc["output_throughput"] > 0
    assert all(len(gaps) >= 1 for gaps in doc["itls"])
