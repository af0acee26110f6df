"""pdserve/net.py: bind/advertise addresses of a worker."""

from __future__ import annotations

import socket

import pytest

from pdserve.config import EngineConfig
from pdserve.net import (
    WorkerAddress,
    engine_config_for,
    listen_socket,
    node_address,
    route_address,
    worker_address,
)

pytestmark = pytest.mark.timeout(30)


def test_default_binds_and_advertises_the_node_ip() -> None:
    assert worker_address(None, "10.1.2.3") == WorkerAddress("10.1.2.3", "10.1.2.3")


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::"])
def test_wildcard_binds_everything_and_advertises_the_node_ip(wildcard: str) -> None:
    assert worker_address(wildcard, "10.1.2.3") == WorkerAddress(wildcard, "10.1.2.3")


def test_a_concrete_host_is_bound_and_advertised() -> None:
    assert worker_address("127.0.0.2", "10.1.2.3") == WorkerAddress("127.0.0.2", "127.0.0.2")


def test_endpoint_brackets_ipv6_and_checks_the_port() -> None:
    assert WorkerAddress("::", "fd00::2").endpoint(50) == "[fd00::2]:50"
    assert WorkerAddress("a", "10.0.0.1").endpoint(8000) == "10.0.0.1:8000"
    with pytest.raises(ValueError, match="port"):
        WorkerAddress("a", "b").endpoint(0)


def test_node_address_outside_ray_is_the_routed_address() -> None:
    assert node_address() == route_address()
    assert route_address("127.0.0.5").startswith("127.")


def test_listen_socket_binds_only_the_given_address() -> None:
    sock = listen_socket("127.0.0.2")
    try:
        port = sock.getsockname()[1]
        socket.create_connection(("127.0.0.2", port), timeout=2).close()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.3", port), timeout=2).close()
    finally:
        sock.close()


def test_engine_config_for_sets_the_kv_addresses_and_token() -> None:
    base = EngineConfig(internal_token="t0k")
    cfg = engine_config_for(base, WorkerAddress("0.0.0.0", "10.0.0.7"))
    assert cfg.transfer.host == "10.0.0.7" and cfg.transfer.bind_host == "0.0.0.0"
    assert cfg.transfer.auth_token == "t0k"
    assert "t0k" not in repr(cfg)
