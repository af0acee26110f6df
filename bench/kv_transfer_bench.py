"""KV transfer throughput and fixed cost over gloo loopback (issue 3, "Measure").

Two OS processes on this machine: this one sends (TorchDistSender), a spawned one receives
(TorchDistReceiver scattering into a KVPool). For each payload size it reports, as medians:

* ``e2e``: header sent -> payload received -> scattered into non-contiguous blocks -> ack
  received (``TransferRecord.ms``);
* ``wire``: the same transfer to an id the receiver did not reserve, so it is drained into the
  staging buffer and dropped (no scatter): the transport alone;
* ``copy``: ``dst.copy_(src)`` of the same number of bytes in this process (the memory bound);
* ``scatter``: ``KVPool.scatter`` of the same payload into the same blocks in this process (the
  receiver's share of ``e2e`` beyond ``wire``);

and the fixed cost of a 1-block transfer (16 tokens of a 1-layer, 1-head, head_dim 8 fp32
layout: 1 KiB), over torch_dist and over the in-process loopback backend (same queues, no gloo).

Run: ``.venv/bin/python bench/kv_transfer_bench.py [--sizes-mib 1 16 64 256] [--repeats 5]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from kv_transfer.base import KVLayout, TransferOutcome
from kv_transfer.loopback import LoopbackReceiver, LoopbackSender
from kv_transfer.torch_dist import TorchDistSender
from pdserve.kv_cache.pool import KVPool

MIB = 1024 * 1024
# 16 layers x 8 KV heads x head_dim 128 in bf16 = 64 KiB per token: 1 MiB is exactly one block.
BIG = KVLayout("bench", "bfloat16", num_layers=16, num_kv_heads=8, head_dim=128, block_size=16)
TINY = KVLayout("bench", "float32", num_layers=1, num_kv_heads=1, head_dim=8, block_size=16)


def _pool(lay: KVLayout, num_blocks: int) -> KVPool:
    return KVPool(
        lay.num_layers, num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim, lay.torch_dtype
    )


def _receiver(conn: Connection, layout_dict: dict[str, Any], num_blocks: int) -> None:
    """Child: a receiver that reserves ids on request: ("reserve", first_id, count, blocks)."""
    from kv_transfer.torch_dist import TorchDistReceiver

    lay = KVLayout.from_dict(layout_dict)
    rx = TorchDistReceiver(_pool(lay, num_blocks), lay, timeout_s=120.0)
    conn.send(rx.endpoint)
    while True:
        try:
            _, first, count, blocks = conn.recv()
        except EOFError:
            break
        for i in range(count):
            rx.expect(first + i, blocks, time.time() + 3600)
        conn.send("ok")
    rx.close()


def _spawn_receiver(lay: KVLayout, num_blocks: int) -> tuple[Any, Connection, str]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, lay.to_dict(), num_blocks), daemon=True)
    proc.start()
    return proc, parent, parent.recv()


def _reserve(conn: Connection, first: int, count: int, blocks: list[int]) -> None:
    conn.send(("reserve", first, count, blocks))
    assert conn.recv() == "ok"


def _timed_sends(
    tx: Any, endpoint: str, first_id: int, kv: torch.Tensor, n: int, outcome: TransferOutcome
) -> list[float]:
    """Send ``kv`` ``n`` times (ids first_id..), one at a time; per-transfer record ms."""
    out = []
    for i in range(n):
        rec = tx.send(endpoint, first_id + i, kv, 1, -0.5).result(timeout=300)
        assert rec.outcome is outcome, rec
        out.append(rec.ms)
    return out


def _time_ms(fn: Any, repeats: int) -> list[float]:
    """Wall ms of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _copy_ms(nbytes: int, repeats: int) -> list[float]:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    return _time_ms(lambda: dst.copy_(src), repeats)


def _scatter_ms(blocks: list[int], kv: torch.Tensor, num_blocks: int, repeats: int) -> list[float]:
    pool = _pool(BIG, num_blocks)
    return _time_ms(lambda: pool.scatter(blocks, kv), repeats)


def bench_throughput(sizes_mib: list[int], repeats: int) -> list[dict[str, float]]:
    """Median e2e / wire / copy ms and GB/s per payload size."""
    max_tokens = max(sizes_mib) * MIB // BIG.bytes_per_token
    num_blocks = max_tokens // BIG.block_size
    proc, conn, endpoint = _spawn_receiver(BIG, num_blocks)
    tx = TorchDistSender(BIG, timeout_s=120.0)
    rows = []
    next_id = 1
    try:
        for mib in sizes_mib:
            tokens = mib * MIB // BIG.bytes_per_token
            nb = tokens // BIG.block_size
            g = torch.Generator().manual_seed(mib)
            perm = torch.randperm(num_blocks, generator=g)[:nb]
            blocks = perm.tolist()  # non-contiguous, unordered
            kv = torch.randn(BIG.payload_shape(tokens)).to(BIG.torch_dtype)
            _reserve(conn, next_id, repeats + 1, blocks)
            e2e = _timed_sends(tx, endpoint, next_id, kv, repeats + 1, TransferOutcome.OK)[1:]
            next_id += repeats + 1
            wire = _timed_sends(
                tx, endpoint, 10**9 + next_id, kv, repeats + 1, TransferOutcome.DROPPED
            )[1:]
            next_id += repeats + 1
            nbytes = kv.nbytes
            copy = _copy_ms(nbytes, repeats)
            scatter = _scatter_ms(blocks, kv, num_blocks, repeats)
            row: dict[str, float] = {"mib": mib}
            for k, ms in (("e2e", e2e), ("wire", wire), ("copy", copy), ("scatter", scatter)):
                row[f"{k}_ms"] = statistics.median(ms)
                row[f"{k}_gbps"] = nbytes / statistics.median(ms) / 1e6
                row[f"{k}_best_gbps"] = nbytes / min(ms) / 1e6
            rows.append(row)
            print(
                f"{mib:>4} MiB  e2e {row['e2e_gbps']:.2f} GB/s ({row['e2e_ms']:.1f} ms)  "
                f"wire {row['wire_gbps']:.2f}  copy {row['copy_gbps']:.2f}  "
                f"scatter {row['scatter_gbps']:.2f} GB/s",
                flush=True,
            )
    finally:
        tx.close()
        conn.close()
        proc.join(10)
    return rows


def bench_fixed_cost(repeats: int) -> dict[str, float]:
    """Median and p90 ms of a 1-block (16-token, 1 KiB) transfer: torch_dist vs loopback."""
    kv = torch.randn(TINY.payload_shape(TINY.block_size))
    out: dict[str, float] = {"payload_bytes": float(kv.nbytes)}
    proc, conn, endpoint = _spawn_receiver(TINY, 64)
    tx = TorchDistSender(TINY, timeout_s=30.0)
    try:
        _reserve(conn, 1, repeats + 10, [37])
        ms = _timed_sends(tx, endpoint, 1, kv, repeats + 10, TransferOutcome.OK)[10:]
        out["torch_dist_ms"] = statistics.median(ms)
        out["torch_dist_p90_ms"] = statistics.quantiles(ms, n=10)[-1]
        t0 = time.perf_counter()
        tx.send(endpoint, 10**9, kv, 1).result(timeout=30)  # dropped: end-to-end incl. future
        out["torch_dist_future_ms"] = (time.perf_counter() - t0) * 1e3
    finally:
        tx.close()
        conn.close()
        proc.join(10)
    rx = LoopbackReceiver(_pool(TINY, 64), TINY)
    lb = LoopbackSender(TINY, timeout_s=30.0)
    try:
        for i in range(repeats + 10):
            rx.expect(i + 1, [37], time.time() + 600)
        ms = _timed_sends(lb, rx.endpoint, 1, kv, repeats + 10, TransferOutcome.OK)[10:]
        out["loopback_ms"] = statistics.median(ms)
    finally:
        lb.close()
        rx.close()
    print(
        f"1-block transfer (1 KiB): torch_dist {out['torch_dist_ms']:.3f} ms median "
        f"(p90 {out['torch_dist_p90_ms']:.3f}), loopback {out['loopback_ms']:.3f} ms",
        flush=True,
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--repeats", type=int, default=5, help="timed transfers per size")
    p.add_argument("--fixed-repeats", type=int, default=200, help="timed 1-block transfers")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args()
    load = open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
        f"{os.cpu_count()} CPUs, load average {load}",
        flush=True,
    )
    rows = bench_throughput(args.sizes_mib, args.repeats)
    result = {"throughput": rows, "fixed_cost": bench_fixed_cost(args.fixed_repeats)}
    print("\nGB/s, median (best) of the repeats:\n")
    print("| payload | e2e (median ms) | wire only | in-process copy | KVPool.scatter |")
    print("|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k + '_gbps']:.2f} ({r[k + '_best_gbps']:.2f})" for k in ("wire", "copy")]
        cells.append(f"{r['scatter_gbps']:.2f} ({r['scatter_best_gbps']:.2f})")
        print(
            f"| {r['mib']} MiB | {r['e2e_gbps']:.2f} ({r['e2e_best_gbps']:.2f}), "
            f"{r['e2e_ms']:.1f} ms | " + " | ".join(cells) + " |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
