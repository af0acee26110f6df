"""Fixtures for the benchmark tests: a scripted fake OpenAI server in its own process."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

FAKE_SERVER = Path(__file__).with_name("fake_openai.py")


@dataclass
class FakeServer:
    """A running fake server: ``base_url`` and its per-request emission log."""

    base_url: str
    proc: subprocess.Popen

    def log(self) -> list[dict[str, Any]]:
        """[{case, t_request, chunk_times}] for every POST so far (perf_counter seconds)."""
        with urllib.request.urlopen(self.base_url + "/log", timeout=10) as resp:
            return json.load(resp)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def start_fake_server(script: dict[str, Any], script_path: Path) -> FakeServer:
    """Start a fake server process with ``script`` (case id -> behaviour; see fake_openai.py)."""
    script_path.write_text(json.dumps(script))
    proc = subprocess.Popen(
        [sys.executable, str(FAKE_SERVER), str(script_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("PORT "), f"fake server did not start: {line!r}"
    return FakeServer(f"http://127.0.0.1:{int(line.split()[1])}", proc)


@pytest.fixture
def fake_server(tmp_path: Path) -> Iterator[Callable[[dict[str, Any]], FakeServer]]:
    """Factory: start a fake server with a script; every server is stopped at teardown."""
    servers: list[FakeServer] = []

    def start(script: dict[str, Any]) -> FakeServer:
        servers.append(start_fake_server(script, tmp_path / f"script{len(servers)}.json"))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
