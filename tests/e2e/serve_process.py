"""Start `pdserve serve` as a subprocess on free ports and wait until it serves (e2e helper)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
# Small KV pools and context keep memory low on a shared 2-core machine.
SMALL = ["--kv-cache-memory-bytes", str(256 * 1024 * 1024), "--max-model-len", "2048"]
# Servers under test run the model eagerly: compiling it (pdserve serve's default on CPU) would
# add up to minutes per server start; tests/engine/test_compile_smollm2.py covers that path.
EAGER = ["--enforce-eager"]
# Short completion prompts whose greedy continuations the e2e modules compare across servers.
PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "The largest planet in the solar system is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The chemical symbol for gold is",
    "In 1969, the first person to walk on the moon was",
    "A haiku about autumn:",
]


# Ports handed out in this process: the kernel may give a just-closed port again, so two servers
# (or two listeners of one, e.g. HTTP and gRPC) could be given the same port. Ray refuses a node
# whose servers got one port twice (seen once in a fresh-clone make test: gcs_server and
# dashboard_agent_grpc).
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` ("0.0.0.0": on every address), never one this process handed out
    before."""
    while True:
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def stop_process(proc: subprocess.Popen, sig: int, timeout_s: float) -> None:
    """Send ``sig`` to ``proc`` (started with its own session) and wait; SIGKILL its process
    group if it does not exit within ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class ServeProcess:
    """`pdserve serve ARGS` on free HTTP and gRPC ports; ``stop()`` sends SIGINT, then kills.

    ``env``: extra environment variables for the child (e.g. PDSERVE_API_KEY). ``command``:
    'router' runs `pdserve router ARGS` instead (no engine flags).
    """

    def __init__(
        self, args: list[str], env: dict[str, str] | None = None, command: str = "serve"
    ) -> None:
        self.args, self.env, self.command = args, env, command
        self.last_output = ""
        self.port_retries = 3  # relaunches after another process took a port picked as free
        self._start()

    def _start(self) -> None:
        """Launch on newly picked free ports (the URL and gRPC address follow them)."""
        self.port = free_port()
        self.grpc_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.grpc_address = f"127.0.0.1:{self.grpc_port}"
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="pdserve-e2e-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable, "-m", "pdserve.cli", self.command,
            "--host", "127.0.0.1", "--port", str(self.port), "--grpc-port", str(self.grpc_port),
            *(SMALL + EAGER if self.command == "serve" else SMALL[2:]), *self.args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(self.env or {})},
            start_new_session=True,
        )

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        """Poll /health until 200. Raises RuntimeError with the server log on exit or timeout."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                # NOTE: a port found free may be taken before the server binds it (Ray's
                # processes bind ephemeral ports too): start again on other ports.
                if "Address already in use" in self.output() and self.port_retries > 0:
                    self.port_retries -= 1
                    self.log.close()
                    Path(self.log.name).unlink(missing_ok=True)
                    self._start()
                    continue
                raise RuntimeError(
                    f"pdserve serve exited ({self.proc.returncode}):\n{self.output()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    if "ready:" in self.output():
                        return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"pdserve serve not ready after {timeout_s} s:\n{self.output()}")

    def stop(self, timeout_s: float = 60.0, sig: int = signal.SIGINT) -> int:
        """``sig`` (Ctrl-C by default), wait for a clean exit; SIGKILL the process group if it
        hangs. The server's log stays readable as ``last_output``."""
        stop_process(self.proc, sig, timeout_s)
        self.last_output = self.output()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


def metric(url: str, name: str, labels: str = "") -> float:
    """Sum of the Prometheus samples ``name`` (optionally only those whose line holds ``labels``)
    on the server at ``url``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not labels or labels in line) and " " in line:
            head = line.split(" ")[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total
