"""A 2-rank ``torch.distributed`` process group for one (prefill, decode) pair.

No global world and no ``init_process_group``: the group is built directly on a
``PrefixStore(pair, store)`` over the decode worker's ``TCPStore`` (DESIGN §5), as
``ProcessGroupGloo`` for CPU tensors or ``ProcessGroupNCCL`` for CUDA tensors. Rank 0 is the
receiver (decode), rank 1 the sender (prefill). Everything else in the backend is device-agnostic.

Timeouts, as observed with gloo over TCP (torch 2.13): a peer that dies fails pending and later
operations at once ("Connection closed by peer"); a ``wait(timeout)`` that expires fails that
operation and closes every pair of the group ("Application timeout caused pair closure"), so a
timed-out group is dead and must be rebuilt; ``abort()`` closes the sockets (the peer sees them
close at once) but does not wake a local ``wait``, which returns only at its own timeout.
NCCL likewise needs an abort after a timeout. Every operation here therefore takes a timeout and
any failure marks the group broken.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, Store

from kv_transfer.address import gloo_device
from kv_transfer.base import ChannelClosedError, KVTransferError, TransferTimeoutError

TAG_HEADER = 1
TAG_PAYLOAD = 2
TAG_ACK = 3
RECEIVER_RANK = 0
SENDER_RANK = 1


def wire_backend(device: torch.device) -> str:
    """'gloo' for CPU tensors, 'nccl' for CUDA tensors. Raises ValueError for other devices."""
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        return "nccl"
    raise ValueError(f"KV transfer over torch.distributed supports cpu|cuda, not {device.type}")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """'host:port' -> (host, port). Raises ValueError naming the bad part."""
    host, sep, port_s = endpoint.rpartition(":")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ValueError(f"KV endpoint must be 'host:port' with port 1..65535, got {endpoint!r}")
    return host.strip("[]"), int(port_s)


def classify(error: BaseException, what: str) -> KVTransferError:
    """A backend exception as TransferTimeoutError (it timed out) or ChannelClosedError."""
    text = f"{what}: {error}"
    low = str(error).lower()
    if "timed out" in low or "timeout" in low:
        return TransferTimeoutError(text)
    return ChannelClosedError(text)


@dataclass(frozen=True)
class Pending:
    """A posted send or receive (``work``) and what it is, for error messages."""

    work: Any  # torch.distributed Work
    what: str


class PairGroup:
    """The process group of one pair plus timed point-to-point operations.

    ``store``: a TCPStore connection (the group keeps it); ``pair``: the pair's key prefix;
    ``rank``: RECEIVER_RANK or SENDER_RANK; ``device``: where the tensors live; ``bind_host``:
    local address gloo listens on (``GLOO_SOCKET_IFNAME``, when set, wins: see address.py); ``timeout_s``: bound on building the group. Raises
    TransferTimeoutError or ChannelClosedError when the peer does not join.
    """

    def __init__(
        self,
        store: Store,
        pair: str,
        rank: int,
        device: torch.device,
        bind_host: str,
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.backend = wire_backend(device)
        prefixed = PrefixStore(pair, store)
        timeout = timedelta(seconds=timeout_s)
        try:
            if self.backend == "gloo":
                # The gloo-specific options (timeout + the device to listen on) are only
                # exposed as the underscored class.
                opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = timeout
                opts._devices = [gloo_device(bind_host)]
                self.pg: Any = ProcessGroupGloo(prefixed, rank, 2, opts)
            else:
                from torch.distributed import ProcessGroupNCCL

                nccl_opts = ProcessGroupNCCL.Options()
                nccl_opts._timeout = timeout
                self.pg = ProcessGroupNCCL(prefixed, rank, 2, nccl_opts)
        except RuntimeError as e:
            raise classify(e, f"building the {self.backend} group {pair!r}") from e
        self.broken = False

    def send(self, tensor: torch.Tensor, tag: int, timeout_s: float) -> None:
        """Send ``tensor`` to the peer; wait at most ``timeout_s``. Raises KVTransferError."""
        self.wait(self.post("send", tensor, tag), timeout_s)

    def recv(self, tensor: torch.Tensor, tag: int, timeout_s: float) -> None:
        """Receive into ``tensor`` from the peer; wait at most ``timeout_s``."""
        self.wait(self.post("recv", tensor, tag), timeout_s)

    def post(self, op: str, tensor: torch.Tensor, tag: int) -> Pending:
        """Start a ``'send'`` or ``'recv'`` without waiting (finish it with :meth:`wait`)."""
        if self.broken:
            raise ChannelClosedError(f"{self.backend} group is closed")
        what = f"{self.backend} {op} of {tensor.numel()} elements"
        try:
            if op == "send":
                work = self.pg.send([tensor], self.peer, tag)
            else:
                work = self.pg.recv([tensor], self.peer, tag)
        except RuntimeError as e:
            self.broken = True
            raise classify(e, what) from e
        return Pending(work, what)

    def wait(self, pending: Pending, timeout_s: float) -> None:
        """Wait for a posted operation at most ``timeout_s``. Raises KVTransferError."""
        if timeout_s <= 0:
            self.broken = True
            raise TransferTimeoutError(f"{pending.what}: no time left")
        try:
            # NOTE: timedelta(0) would mean "the group's default"; keep at least 1 ms.
            pending.work.wait(timedelta(seconds=max(timeout_s, 1e-3)))
        except RuntimeError as e:
            self.broken = True
            raise classify(e, pending.what) from e

    def abort(self) -> None:
        """Close the group's connections (the peer sees them close). Idempotent."""
        self.broken = True
        try:
            self.pg.abort()
        except RuntimeError:
            pass
