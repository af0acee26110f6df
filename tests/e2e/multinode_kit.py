"""A multi-node Ray cluster on one machine, for e2e tests (DESIGN §8).

Each node is one ``ray start --block`` process at its own loopback address (all of 127.0.0.0/8 is
loopback on Linux) with its own free ports and custom resources; the cluster uses Ray's token
authentication with a random token that only the processes started here see. Every node is
stopped by its pid: SIGTERM to its ``ray start --block`` process (which stops the node's
processes), then SIGKILL to that process's own process group if it lingers. Nothing is stopped
by name and ``ray stop`` is never run (other jobs on the machine may run Ray).

NOTE: Ray reports a head started at 127.0.0.1 under the machine's routable address (it replaces
loopback for the head); worker nodes keep their 127.0.0.x addresses.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from serve_process import free_port as serve_free_port
from serve_process import stop_process

RAY = str(Path(sys.executable).with_name("ray"))
OBJECT_STORE_BYTES = 80 * 1024 * 1024  # the minimum Ray accepts is 75 MiB


def free_port() -> int:
    """A port free on every address (some Ray servers bind all interfaces), never one this
    process handed out before."""
    return serve_free_port("0.0.0.0")


def _node_ports() -> list[str]:
    """Free ports for every server a Ray node opens (defaults would collide between nodes)."""
    flags = [
        "--node-manager-port",
        "--object-manager-port",
        "--metrics-export-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
    ]
    out: list[str] = []
    for flag in flags:
        out += [flag, str(free_port())]
    return out


class RayNode:
    """One ``ray start --block`` process; ``stop()`` ends it and its node by pid."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(
            [RAY, "start", "--block", "--disable-usage-stats", *args],
            env=env,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the fallback kill stays ours
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout_s: float = 30.0, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the node's ``ray start`` process; SIGKILL its group if it hangs."""
        stop_process(self.proc, sig, timeout_s)
        # Processes of the node that outlived their `ray start` (same process group).
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log_file.close()

    def kill(self, *extra_pids: int) -> None:
        """Lose the node at once: SIGKILL ``extra_pids`` (processes Ray started on it, such as
        a worker actor) and this node's process group, then reap ``ray start``."""
        for pid in extra_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stop(sig=signal.SIGKILL)


class LocalCluster:
    """A head (no CPUs: router only) plus worker nodes, all on loopback addresses.

    ``env`` is what every process that talks to the cluster needs (token authentication).
    """

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "GRPC_ENABLE_FORK_SUPPORT": "0",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.dir = Path(tempfile.mkdtemp(prefix="pdserve-mn-"))
        self.gcs_port = free_port()
        self.address = f"127.0.0.1:{self.gcs_port}"
        self.nodes: dict[str, RayNode] = {}

    def start_head(self) -> None:
        """The head at 127.0.0.1 with --num-cpus=0; returns once its GCS accepts connections."""
        args = [
            "--head",
            "--node-ip-address", "127.0.0.1",
            "--port", str(self.gcs_port),
            "--num-cpus", "0",
            "--include-dashboard", "false",
            "--dashboard-port", str(free_port()),
            "--ray-client-server-port", str(free_port()),
            "--temp-dir", str(self.dir / "head"),
            "--object-store-memory", str(OBJECT_STORE_BYTES),
            *_node_ports(),
        ]  # fmt: skip
        self.nodes["head"] = RayNode(args, self.env, self.dir / "head.log")
        self._wait_port("127.0.0.1", self.gcs_port, self.nodes["head"])

    def add_node(self, ip: str, resources: dict[str, float], num_cpus: float = 1) -> RayNode:
        """A worker node at ``ip`` advertising ``resources`` (joins asynchronously)."""
        args = [
            "--address", self.address,
            "--node-ip-address", ip,
            "--num-cpus", str(num_cpus),
            "--resources", json.dumps(resources),
            "--object-store-memory", str(OBJECT_STORE_BYTES),
            # its own temp dir: nodes on one machine would share the head's socket paths
            "--temp-dir", str(self.dir / ip.rsplit(".", 1)[1]),
            *_node_ports(),
        ]  # fmt: skip
        node = RayNode(args, self.env, self.dir / f"node-{ip}.log")
        self.nodes[ip] = node
        return node

    def stop(self) -> None:
        """Stop every node by pid (workers first, head last) and remove the temp dir."""
        for name in [n for n in self.nodes if n != "head"] + ["head"]:
            if name in self.nodes:
                self.nodes[name].stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def logs(self) -> str:
        """The nodes' `ray start` output (for failure messages)."""
        return "\n".join(
            f"--- {name}\n{node.log.read_text(errors='replace')[-3000:]}"
            for name, node in self.nodes.items()
            if node.log.exists()
        )

    @staticmethod
    def _wait_port(host: str, port: int, node: RayNode, timeout_s: float = 120.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if node.proc.poll() is not None:
                raise RuntimeError(
                    f"ray start exited ({node.proc.returncode}):\n{node.log.read_text()}"
                )
            try:
                with socket.create_connection((host, port), timeout=1):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"Ray head not up after {timeout_s} s:\n{node.log.read_text()}")


def _established(pid: int) -> set[tuple[str, str]]:
    """(local 'ip:port', peer 'ip:port') of each established TCP connection of process ``pid``."""
    return {
        (f"{c.laddr.ip}:{c.laddr.port}", f"{c.raddr.ip}:{c.raddr.port}")
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.raddr
    }


def connections_between(pid_a: int, pid_b: int) -> list[tuple[str, str]]:
    """Established TCP connections between processes ``pid_a`` and ``pid_b`` on this machine,
    as ('ip:port' at a, 'ip:port' at b)."""
    at_b = _established(pid_b)
    return sorted((local, peer) for local, peer in _established(pid_a) if (peer, local) in at_b)
