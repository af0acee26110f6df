"""What a worker actor reports when it starts, and what the router's pool keeps per worker."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerInfo:
    """A started worker. Crosses the Ray boundary (plain, picklable fields only).

    ``role``: 'prefill' | 'decode'. ``grpc_address``: 'host:port' of its gRPC service.
    ``kv_endpoint``: 'host:port' of its KV receiver (decode) or '' (prefill).
    ``num_blocks``/``block_size``: its KV pool geometry (blocks, tokens per block).
    ``node_address``: the IP of the node it runs on (what both addresses advertise).
    ``device``: where its model runs ('cpu', 'cuda', 'cuda:1', ...; '' when not reported).
    """

    worker_id: str
    role: str
    grpc_address: str
    kv_endpoint: str = ""
    num_blocks: int = 0
    block_size: int = 16
    pid: int = 0
    node_address: str = ""
    device: str = ""
