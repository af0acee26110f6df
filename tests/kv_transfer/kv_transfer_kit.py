"""Shared pieces of the kv_transfer tests: tiny layouts, deterministic KV, child processes.

Child processes are started with the ``spawn`` context (a fresh interpreter, as on a real
deployment); their entry points live here so the children can import them. Every child talks to
the test over a ``multiprocessing`` pipe and exits when the pipe closes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from kv_transfer.base import KVLayout
from pdserve.kv_cache.pool import KVPool

BLOCK_SIZE = 16


def layout(dtype: str = "float32", head_dim: int = 16, model_id: str = "tiny") -> KVLayout:
    """A tiny KV layout: 2 layers, 2 KV heads, ``head_dim``, blocks of 16 tokens."""
    return KVLayout(
        model_id=model_id,
        dtype=dtype,
        num_layers=2,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=BLOCK_SIZE,
    )


def make_pool(lay: KVLayout, num_blocks: int = 128) -> KVPool:
    """A zeroed CPU pool of ``lay``."""
    return KVPool(
        lay.num_layers,
        num_blocks,
        lay.block_size,
        lay.num_kv_heads,
        lay.head_dim,
        lay.torch_dtype,
    )


def random_kv(lay: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    """Deterministic random KV ``[L, 2, num_tokens, H, D]`` (same on every process)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(lay.payload_shape(num_tokens), generator=g).to(lay.torch_dtype)


def scattered_blocks(num_tokens: int, num_blocks: int, seed: int) -> list[int]:
    """Random, non-contiguous, unordered block ids covering ``num_tokens`` tokens."""
    need = -(-num_tokens // BLOCK_SIZE)
    rng = random.Random(seed)
    while True:
        ids = rng.sample(range(num_blocks), need)
        if need == 1 or any(b - a != 1 for a, b in zip(ids, ids[1:], strict=False)):
            return ids


def spawn(target: Any, *args: Any) -> tuple[mp.process.BaseProcess, Connection]:
    """Start ``target(conn, *args)`` in a spawned process; returns (process, parent end)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def recv(conn: Connection, timeout_s: float = 30.0) -> Any:
    """The next message from a child; raises TimeoutError naming the wait."""
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no message from the child process within {timeout_s} s")
    msg = conn.recv()
    if isinstance(msg, BaseException):
        raise msg
    return msg


# ----------------------------------------------------------------------------- child entries
def receiver_child(
    conn: Connection, layout_dict: dict[str, Any], port: int, num_blocks: int, die_on_header: bool
) -> None:
    """A decode-side process: a TorchDistReceiver driven by commands from the pipe.

    Sends its endpoint first, then answers ``("expect", tid, blocks, deadline)`` with "ok",
    ``("wait", tid, blocks, timeout)`` with ``(first_token, first_logprob, num_tokens, kv)``
    gathered from the pool, and ``("stats",)``. ``die_on_header``: the process exits as soon as
    a TRANSFER header arrives, i.e. with that transfer's payload still in flight.
    """
    torch.set_num_threads(1)
    from kv_transfer.torch_dist import TorchDistReceiver

    lay = KVLayout.from_dict(layout_dict)
    pool = make_pool(lay, num_blocks)

    def die(_header: Any) -> None:
        os._exit(17)

    rx = TorchDistReceiver(
        pool, lay, port=port, timeout_s=10.0, on_header=die if die_on_header else None
    )
    futures: dict[int, Any] = {}
    conn.send(rx.endpoint)
    try:
        while True:
            try:
                cmd = conn.recv()
            except EOFError:
                return
            try:
                if cmd[0] == "expect":
                    futures[cmd[1]] = rx.expect(cmd[1], cmd[2], cmd[3])
                    conn.send("ok")
                elif cmd[0] == "wait":
                    res = futures.pop(cmd[1]).result(timeout=cmd[3])
                    kv = pool.gather(cmd[2], res.num_tokens)
                    conn.send((res.first_token, res.first_logprob, res.num_tokens, kv))
                elif cmd[0] == "stats":
                    conn.send(rx.stats())
            except Exception as e:  # noqa: BLE001 - report every failure to the test
                conn.send(e)
    finally:
        rx.close()


def sender_child(
    conn: Connection,
    layout_dict: dict[str, Any],
    endpoint: str,
    jobs: Sequence[tuple[int, int, int]],
) -> None:
    """A prefill-side process: queue every ``(transfer_id, num_tokens, seed)`` at once on one
    channel, then report ``[(transfer_id, outcome, bytes)]`` (or the first exception)."""
    torch.set_num_threads(1)
    from kv_transfer.torch_dist import TorchDistSender

    lay = KVLayout.from_dict(layout_dict)
    tx = TorchDistSender(lay, timeout_s=20.0)
    try:
        conn.recv()  # go
        futs = [
            (tid, tx.send(endpoint, tid, random_kv(lay, n, seed), tid % 1000, -0.5 * seed))
            for tid, n, seed in jobs
        ]
        out = []
        for tid, f in futs:
            rec = f.result(timeout=60)
            out.append((tid, rec.outcome.value, rec.bytes))
        conn.send(out)
    except Exception as e:  # noqa: BLE001 - report every failure to the test
        conn.send(e)
    finally:
        tx.close()


def wait_gone(proc: mp.process.BaseProcess, timeout_s: float = 10.0) -> None:
    """Join ``proc``; kill it if it outlives ``timeout_s``."""
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5.0)


def deadline_in(seconds: float) -> float:
    """A ``time.time()`` deadline ``seconds`` from now."""
    return time.time() + seconds
