"""Network addresses of KV pair channels: the store's listening socket and gloo's interface.

A decode worker's receiver listens on its *bind* address (its node IP, or a wildcard from
``--worker-host``) and advertises its node IP in its endpoint; a prefill worker connects to that
endpoint. Each side's gloo device then listens on the address that routes to the peer, or on the
interface named by ``GLOO_SOCKET_IFNAME`` when the operator set it (as ``torch.distributed``
does for its own groups). NCCL reads ``NCCL_SOCKET_IFNAME`` itself, so nothing is done for it.
"""

from __future__ import annotations

import socket
from typing import Any

from torch.distributed import ProcessGroupGloo

from pdserve import env
from pdserve.net import listen_socket, route_address


def local_address_toward(host: str) -> str:
    """The local IP address the OS routes to ``host`` from (no packet is sent)."""
    return route_address(host)


def gloo_device(address: str) -> Any:
    """A gloo transport device: on ``GLOO_SOCKET_IFNAME``'s interface when set, else on
    ``address`` (a local IP that routes to the peer)."""
    ifname = env.gloo_socket_ifname()
    if ifname:
        return ProcessGroupGloo.create_device(interface=ifname)
    return ProcessGroupGloo.create_device(hostname=address)


def store_listen_socket(host: str, port: int) -> socket.socket:
    """The listening socket a receiver's TCPStore serves on (``host:port``, port 0 = free).

    Bound here rather than by TCPStore, which would listen on every interface whatever host it
    is given. Raises OSError when the address cannot be bound.
    """
    return listen_socket(host, port)
