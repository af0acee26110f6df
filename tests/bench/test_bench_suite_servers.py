"""Server processes of the suite (start, wait for /health, stop by pid) and the peer script's
location; every process here is a small local stand-in on loopback."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from pdserve.bench.suite.servers import (
    PDSERVE_READY_LINE,
    ServerError,
    ServerProcess,
    ServerSpec,
    free_port,
    pdserve_spec,
)
from pdserve.bench.suite.vllm_peer import PEER_ENV, PeerError, VllmPeer

pytestmark = pytest.mark.timeout(120)
FAKE_SERVER = Path(__file__).with_name("fake_openai.py")


def _fake_spec(tmp_path: Path, ready_text: str | None = None) -> ServerSpec:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({}))
    port = free_port()
    argv = (sys.executable, str(FAKE_SERVER), str(script), str(port))
    return ServerSpec("fake", argv, port, ready_text=ready_text)


def test_start_wait_ready_and_stop(tmp_path: Path) -> None:
    server = ServerProcess(_fake_spec(tmp_path), tmp_path / "logs" / "fake.log")
    with server:
        assert server.wait_ready(30.0) >= 0
        assert server.ready_s is not None
        assert server.proc is not None and server.proc.poll() is None
    assert server.proc.poll() is not None  # stopped on leaving the block
    assert "PORT" in server.log_tail()


def test_ready_text_must_appear_in_the_log(tmp_path: Path) -> None:
    server = ServerProcess(_fake_spec(tmp_path, "never printed"), tmp_path / "fake.log")
    with server, pytest.raises(ServerError, match="not ready after 3 s"):
        server.wait_ready(3.0)


def test_early_exit_reports_the_log(tmp_path: Path) -> None:
    code = "import sys; print('cannot load the model', flush=True); sys.exit(3)"
    spec = ServerSpec("broken", (sys.executable, "-c", code), free_port())
    server = ServerProcess(spec, tmp_path / "broken.log")
    with server, pytest.raises(ServerError, match="exited with 3") as info:
        server.wait_ready(30.0)
    assert "cannot load the model" in str(info.value)


def test_stop_kills_a_server_that_ignores_sigint(tmp_path: Path) -> None:
    code = (
        "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(120)"
    )
    server = ServerProcess(ServerSpec("stubborn", (sys.executable, "-c", code), free_port()),
                           tmp_path / "stubborn.log")  # fmt: skip
    server.start()
    deadline = time.monotonic() + 30
    while "up" not in server.log_tail() and time.monotonic() < deadline:
        time.sleep(0.05)  # SIGINT must come after the handler is installed
    assert server.stop(timeout_s=1.0) == -signal.SIGKILL
    assert ServerProcess(server.spec, tmp_path / "x.log").stop() is None  # never started


def test_pdserve_spec_flags() -> None:
    spec = pdserve_spec("unified", "smollm2", "float32", 2048, ("--max-num-seqs", "32"))
    argv = list(spec.argv)
    assert argv[1:4] == ["-m", "pdserve.cli", "serve"]
    for flag, value in (("--mode", "unified"), ("--dtype", "float32"), ("--host", "127.0.0.1"),
                        ("--port", str(spec.port)), ("--max-model-len", "2048")):  # fmt: skip
        assert argv[argv.index(flag) + 1] == value
    assert argv[-2:] == ["--max-num-seqs", "32"]
    assert spec.name == "pdserve-unified" and spec.ready_text == PDSERVE_READY_LINE
    assert spec.base_url == f"http://127.0.0.1:{spec.port}"


def test_peer_location(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PEER_ENV, raising=False)
    with pytest.raises(PeerError, match="vLLM peer script not found") as info:
        VllmPeer.locate(None, tmp_path)  # default ../shared/peers/vllm-cpu.sh: absent here
    assert "\n" not in str(info.value) and "--vllm-peer" in str(info.value)
    script = tmp_path / "peer.sh"
    script.write_text("#!/bin/sh\necho /models/hf\n")
    with pytest.raises(PeerError, match="not executable"):
        VllmPeer.locate(str(script), tmp_path)
    os.chmod(script, 0o755)
    assert VllmPeer.locate("peer.sh", tmp_path).script == script.resolve()  # relative: repo root
    monkeypatch.setenv(PEER_ENV, str(script))
    peer = VllmPeer.locate(None, Path("/"))
    assert peer.script == script.resolve() and peer.hf_dir() == "/models/hf"
    spec = peer.serve_spec("bfloat16")
    assert spec.argv == (str(script.resolve()), "serve", str(spec.port), "bfloat16")
    assert spec.name == "vllm" and spec.ready_text is None
