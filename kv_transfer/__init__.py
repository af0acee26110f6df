"""KV block transport between prefill and decode workers (DESIGN §5).

Backends register here by name; workers build theirs with :func:`make_sender` (prefill) and
:func:`make_receiver` (decode) from their :class:`~pdserve.config.TransferConfig`:

    receiver = make_receiver(config.transfer, runner.kv_pool, layout)     # decode worker
    fut = receiver.expect(transfer_id, block_table, deadline)             # -> TransferResult
    sender = make_sender(config.transfer, layout, device="cpu")           # prefill worker
    fut = sender.send(receiver.endpoint, transfer_id, kv, token, logprob) # -> TransferRecord

``torch_dist``: 2-rank gloo (CPU) / NCCL (CUDA) groups per pair; ``loopback``: in-process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kv_transfer.base import (
    PROTOCOL_VERSION,
    ChannelClosedError,
    KVLayout,
    KVReceiver,
    KVSender,
    KVTransferError,
    LayoutMismatchError,
    TransferExpiredError,
    TransferOutcome,
    TransferRecord,
    TransferResult,
    TransferState,
    TransferStats,
    TransferTimeoutError,
)

if TYPE_CHECKING:
    from pdserve.config import TransferConfig
    from pdserve.engine.faults import FaultInjector
    from pdserve.kv_cache.pool import KVPool

# (layout, *, device, timeout_s, checksum, auth_token, host, faults)
SenderFactory = Callable[..., KVSender]
# (pool, layout, *, host, port, timeout_s, bind_host, auth_token)
ReceiverFactory = Callable[..., KVReceiver]


@dataclass(frozen=True)
class Backend:
    """A registered transport: how to build its sender and its receiver."""

    name: str
    sender: SenderFactory
    receiver: ReceiverFactory


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, sender: SenderFactory, receiver: ReceiverFactory) -> None:
    """Register (or replace) the transport ``name``."""
    _BACKENDS[name] = Backend(name, sender, receiver)


def get_backend(name: str) -> Backend:
    """The transport ``name``. Raises ValueError listing the registered ones."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"KV transfer backend {name!r} is not one of {sorted(_BACKENDS)}"
        ) from None


def make_sender(
    config: TransferConfig,
    layout: KVLayout,
    device: str | torch.device = "cpu",
    faults: FaultInjector | None = None,
) -> KVSender:
    """A sender of ``config.backend`` for KV of ``layout`` living on ``device``; ``faults``
    (tests, --enable-fault-injection) may stall or corrupt its transfers and turns the checksum
    on."""
    return get_backend(config.backend).sender(
        layout,
        device=device,
        timeout_s=config.timeout_s,
        checksum=config.checksum,
        auth_token=config.auth_token,
        host=config.host,
        faults=faults,
    )


def make_receiver(
    config: TransferConfig, pool: KVPool, layout: KVLayout, port: int = 0
) -> KVReceiver:
    """A receiver of ``config.backend`` scattering into ``pool``, listening on
    ``config.bind_host`` (default ``config.host``) port ``port`` (0 = a free port) and
    advertising ``config.host`` in :attr:`KVReceiver.endpoint`."""
    return get_backend(config.backend).receiver(
        pool,
        layout,
        host=config.host,
        port=port,
        timeout_s=config.timeout_s,
        bind_host=config.bind_host,
        auth_token=config.auth_token,
    )


def _register_builtin() -> None:
    from kv_transfer.loopback import LoopbackReceiver, LoopbackSender
    from kv_transfer.torch_dist import TorchDistReceiver, TorchDistSender

    register_backend("torch_dist", TorchDistSender, TorchDistReceiver)
    register_backend("loopback", LoopbackSender, LoopbackReceiver)


_register_builtin()

__all__ = [
    "PROTOCOL_VERSION",
    "Backend",
    "ChannelClosedError",
    "KVLayout",
    "KVReceiver",
    "KVSender",
    "KVTransferError",
    "LayoutMismatchError",
    "TransferExpiredError",
    "TransferOutcome",
    "TransferRecord",
    "TransferResult",
    "TransferState",
    "TransferStats",
    "TransferTimeoutError",
    "get_backend",
    "make_receiver",
    "make_sender",
    "register_backend",
]
