"""Which address a worker binds and which it advertises (DESIGN §8, multi-node).

A worker serves gRPC and (decode) a KV receiver. Other nodes reach it only at the address it
advertises in :class:`~pdserve.worker_info.WorkerInfo`, so that address must be one its node is
reachable at: the node's IP as Ray knows it (``ray start --node-ip-address``, or the address Ray
picked), never 127.0.0.1 unless that really is the node (one-machine setups and tests).

``--worker-host`` overrides where the worker *binds*: a wildcard (``0.0.0.0`` / ``::``) listens on
every interface and still advertises the node IP; a concrete address is bound and advertised.

Torch-free and Ray-free at import time: :func:`node_address` asks Ray only when the calling
process is a connected Ray worker.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
from dataclasses import dataclass

from pdserve.config import EngineConfig

WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class WorkerAddress:
    """Where a worker listens (``bind``) and the address it tells others (``advertise``)."""

    bind: str
    advertise: str

    def endpoint(self, port: int) -> str:
        """'advertise:port' ('[v6]:port' for IPv6). Raises ValueError for a port out of range."""
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        host = f"[{self.advertise}]" if ":" in self.advertise else self.advertise
        return f"{host}:{port}"


def route_address(peer: str = "192.0.2.1") -> str:
    """The local IP the OS routes toward ``peer`` (no packet is sent); 127.0.0.1 if none.

    The default peer is a TEST-NET-1 address (RFC 5737): any route out of the machine will do.
    """
    try:
        family, _, _, _, addr = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def node_address() -> str:
    """This node's address: Ray's node IP inside a connected Ray process, else the routed one."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return str(ray.util.get_node_ip_address())
    return route_address()


def worker_address(worker_host: str | None, node_ip: str | None = None) -> WorkerAddress:
    """Bind/advertise pair for ``--worker-host`` (None = the node IP) on node ``node_ip``.

    ``node_ip`` None = :func:`node_address`. A wildcard ``worker_host`` binds every interface
    and advertises the node IP; any other value is bound and advertised as given.
    """
    node = node_ip or node_address()
    if worker_host is None:
        return WorkerAddress(bind=node, advertise=node)
    if worker_host in WILDCARDS:
        return WorkerAddress(bind=worker_host or "0.0.0.0", advertise=node)
    return WorkerAddress(bind=worker_host, advertise=worker_host)


def listen_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0 = a free port) and listening.

    Raises OSError when the address cannot be bound (not local, port taken).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def engine_config_for(config: EngineConfig, address: WorkerAddress) -> EngineConfig:
    """``config`` as one worker on one node runs it: its KV receiver advertises
    ``address.advertise``, listens on ``address.bind`` and requires ``config.internal_token``."""
    transfer = dataclasses.replace(
        config.transfer,
        host=address.advertise,
        bind_host=address.bind,
        auth_token=config.internal_token,
    )
    return dataclasses.replace(config, transfer=transfer)
