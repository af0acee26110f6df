"""Servers the suite starts itself: pdserve in one mode, or the vLLM peer, on loopback.

Lifecycle of a :class:`ServerProcess`: ``start()`` runs the command in a session of its own (so
its whole process group can be found by the id we hold), its output going to a log file;
``wait_ready()`` polls ``GET /health`` until it answers 200 (and, for pdserve, until the log holds
its ``ready:`` line, printed once every worker has registered), failing early with the log's tail
if the process exits; ``stop()`` sends SIGINT (a clean shutdown: pdserve stops its workers and
Ray), then SIGKILL to the process group it created if it has not exited in time. Nothing is
ever stopped by name.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

# pdserve prints this line once every worker has registered (pdserve/commands/serve.py).
PDSERVE_READY_LINE = "ready: model"
REPO_ROOT = Path(__file__).resolve().parents[3]


class ServerError(RuntimeError):
    """A server did not start, exited early, or did not become ready in time."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ServerSpec:
    """How to start one server. ``port``: its HTTP port on 127.0.0.1; ``ready_text``: text its
    log must hold before it counts as ready (None: ``/health`` alone); ``env``: added variables."""

    name: str
    argv: tuple[str, ...]
    port: int
    ready_text: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = REPO_ROOT

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"


def pdserve_spec(
    mode: str, model: str, dtype: str, max_model_len: int, extra_args: tuple[str, ...] = ()
) -> ServerSpec:
    """``pdserve serve`` in ``mode`` ('disaggregated' | 'unified') on free HTTP and gRPC ports."""
    port, grpc_port = free_port(), free_port()
    argv = (
        sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--mode", mode,
        "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port),
        "--grpc-port", str(grpc_port), "--max-model-len", str(max_model_len), *extra_args,
    )  # fmt: skip
    return ServerSpec(f"pdserve-{mode}", argv, port, ready_text=PDSERVE_READY_LINE)


class ServerProcess:
    """One running server (see the module docstring). Use as a context manager."""

    def __init__(self, spec: ServerSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s: float | None = None  # seconds from start() to ready

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return self.spec.base_url

    def start(self) -> None:
        """Start the command (own session, output to ``log_path``). Raises ServerError."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            try:
                self.proc = subprocess.Popen(
                    list(self.spec.argv),
                    cwd=self.spec.cwd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **self.spec.env},
                    start_new_session=True,
                )
            except OSError as e:
                raise ServerError(f"{self.spec.name}: cannot start {self.spec.argv[0]}: {e}") from e

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the server's output."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as resp:
                ok = resp.status == 200
        except (urllib.error.URLError, OSError):
            return False
        if ok and self.spec.ready_text is not None:
            return self.spec.ready_text in self.log_tail(1_000_000)
        return ok

    def wait_ready(self, timeout_s: float) -> float:
        """Block until ready; returns seconds since start. Raises ServerError (exit or timeout),
        quoting the log's tail and naming the log file."""
        assert self.proc is not None, "start() first"
        deadline = self._t0 + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.spec.name} exited with {self.proc.returncode} before it was ready "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            if self._healthy():
                self.ready_s = time.monotonic() - self._t0
                return self.ready_s
            time.sleep(1.0)
        raise ServerError(
            f"{self.spec.name} not ready after {timeout_s:.0f} s (log {self.log_path}):\n"
            f"{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGINT, wait ``timeout_s``; then SIGKILL the process group this object created.

        Returns the exit code (None if it was never started).
        """
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of the session we started, if any
        except (ProcessLookupError, PermissionError):
            pass
        return proc.wait()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
