"""KV pair channels across node addresses and with the internal token (issue 11).

Loopback addresses stand in for nodes (all of 127.0.0.0/8 is loopback on Linux): a receiver on
"node" 127.0.0.3 listens on that address only, a sender on 127.0.0.2 builds its gloo socket there;
a hello without the receiver's internal token is refused before anything is built.
"""

from __future__ import annotations

import logging
import socket

import psutil
import pytest
import torch
from kv_transfer_kit import deadline_in, layout, make_pool, random_kv

from kv_transfer import make_receiver, make_sender
from kv_transfer.base import TransferOutcome, UnauthenticatedError
from kv_transfer.torch_dist import TorchDistReceiver, TorchDistSender
from pdserve.config import TransferConfig

pytestmark = pytest.mark.timeout(90)

TOKEN = "kv-secret-123"


def listening_on(port: int) -> list[str]:
    """'ip:port' of this process's listening TCP sockets on ``port``."""
    return [
        f"{c.laddr.ip}:{c.laddr.port}"
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]


def test_receiver_binds_its_node_address_only_and_the_sender_its_own() -> None:
    lay = layout()
    pool = make_pool(lay, num_blocks=8)
    rx = make_receiver(
        TransferConfig(host="127.0.0.3", auth_token=TOKEN, timeout_s=10.0), pool, lay
    )
    tx = make_sender(TransferConfig(host="127.0.0.2", auth_token=TOKEN, timeout_s=10.0), lay)
    try:
        assert isinstance(rx, TorchDistReceiver) and isinstance(tx, TorchDistSender)
        host, _, port = rx.endpoint.rpartition(":")
        assert host == "127.0.0.3"
        assert listening_on(int(port)) == [f"127.0.0.3:{port}"]
        with pytest.raises(OSError):  # not reachable at another address of the machine
            socket.create_connection(("127.0.0.4", int(port)), timeout=2).close()

        kv = random_kv(lay, 20, seed=3)
        fut = rx.expect(7, [5, 2], deadline_in(30))
        rec = tx.send(rx.endpoint, 7, kv, 11).result(timeout=30)
        assert rec.outcome is TransferOutcome.OK and fut.result(timeout=10).first_token == 11
        assert torch.equal(pool.gather([5, 2], 20), kv)
        assert rx.stats().channels_opened == 1
    finally:
        tx.close()
        rx.close()


def test_wildcard_bind_advertises_the_given_host() -> None:
    lay = layout()
    rx = make_receiver(
        TransferConfig(host="127.0.0.3", bind_host="0.0.0.0", timeout_s=10.0),
        make_pool(lay, num_blocks=4),
        lay,
    )
    try:
        host, _, port = rx.endpoint.rpartition(":")
        assert host == "127.0.0.3"
        assert listening_on(int(port)) == [f"0.0.0.0:{port}"]
    finally:
        rx.close()


@pytest.mark.parametrize("presented", [None, "wrong-token"], ids=["no-token", "wrong-token"])
def test_handshake_without_the_token_is_refused_and_leaves_nothing(
    presented: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    lay = layout()
    pool = make_pool(lay, num_blocks=8)
    rx = TorchDistReceiver(pool, lay, host="127.0.0.3", timeout_s=10.0, auth_token=TOKEN)
    tx = TorchDistSender(lay, timeout_s=10.0, auth_token=presented)
    try:
        fut = rx.expect(1, [0, 1], deadline_in(60))
        caplog.set_level(logging.WARNING, logger="kv_transfer.torch_dist")
        with pytest.raises(UnauthenticatedError, match="internal token"):
            tx.send(rx.endpoint, 1, random_kv(lay, 20, seed=0), 0).result(timeout=20)
        stats = rx.stats()
        assert stats.handshake_failures == 1 and "unauthenticated" in stats.last_error
        assert rx.num_channels() == 0 and stats.channels_opened == 0
        assert torch.count_nonzero(pool.kv) == 0  # nothing was written
        assert not fut.done()  # the reservation still waits for an authorised sender
        assert TOKEN not in caplog.text and (presented or TOKEN) not in caplog.text

        good = TorchDistSender(lay, timeout_s=10.0, auth_token=TOKEN)
        try:
            kv = random_kv(lay, 20, seed=1)
            assert good.send(rx.endpoint, 1, kv, 5).result(timeout=30).outcome is (
                TransferOutcome.OK
            )
            assert torch.equal(pool.gather([0, 1], 20), kv)
        finally:
            good.close()
    finally:
        tx.close()
        rx.close()
