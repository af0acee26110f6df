"""Where a decode worker's KV blocks land, and what that costs a decode step.

Two parts:

* **placement**: drives a :class:`~pdserve.kv_cache.manager.KVCacheManager` the way the decode
  scheduler does (``--num-blocks`` blocks of 16 tokens, ``--concurrency`` requests at a time,
  ``--prompt-len``-token prompts whose first 16 tokens are shared, ``--output-len`` tokens each,
  one block appended per 16 decoded tokens, prefix caching on) for ``--requests`` requests and
  reports the share of each finished table's blocks that sit right after their predecessor
  (block id + 1). It then keeps the tables of the requests live at that moment.
* **step** (skipped with ``--no-step``): one decode step of those sequences, a prompt of random
  tokens prefilled into each table first, timed over three copies of the same tables in
  disjoint parts of one pool, interleaved round by round in one process: each table remapped to
  contiguous blocks, the allocator's blocks, and every block shuffled. The step reads the
  sequences' whole KV, so the difference between the columns is what the layout costs the
  attention's memory reads.

    .venv/bin/python bench/kv_placement.py --dtype float32 --requests 1000
    .venv/bin/python bench/kv_placement.py --requests 65,400,1000 --no-step

Session 36 (docs/benchmarks.md): fp32, 16 sequences after 1000 requests, one thread, no helper
(``PDSERVE_CPU_DECODE_HELPER=0``): the allocator's tables 1.061x the contiguous step, every
block shuffled 1.077x; the placement before that session (FIFO free queue, evictions in LRU
order), timed from a /tmp copy of this simulation, 1.11-1.16x.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.batch import ScheduledSeq  # noqa: E402
from pdserve.engine.runner import ModelRunner  # noqa: E402
from pdserve.kv_cache.manager import KVCacheManager  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402

BLOCK = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--requests", default="1000", help="requests before the snapshot (a list)")
    p.add_argument("--num-blocks", type=int, default=2912, help="the decode worker's KV blocks")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=286)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-step", action="store_true", help="placement only: no model, no timing")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=10, help="decode steps per timed round")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds; medians reported")
    return p.parse_args(argv)


def place(args: argparse.Namespace, requests: int) -> tuple[float, list[tuple[list[int], int]]]:
    """Run ``requests`` requests through a KVCacheManager as a decode worker would.

    Returns (share of finished tables' blocks adjacent to their predecessor, the live tables as
    (block table, tokens in the KV) when the last request was admitted)."""
    kv = KVCacheManager(args.num_blocks, BLOCK)
    rng = random.Random(args.seed)
    shared = [rng.randrange(1000, 40000) for _ in range(BLOCK)]
    live: dict[str, list[int]] = {}
    started = adjacent = pairs = 0
    snapshot: list[tuple[list[int], int]] = []

    def admit() -> None:
        nonlocal started
        rid = f"r{started}"
        started += 1
        prompt = shared + [rng.randrange(1000, 40000) for _ in range(args.prompt_len - BLOCK)]
        blocks, _ = kv.get_computed_blocks(prompt)
        if kv.allocate_slots(rid, len(prompt), blocks, args.output_len) is None:
            raise SystemExit("bench/kv_placement.py: error: the pool is too small")
        kv.cache_blocks(rid, prompt, len(prompt))
        live[rid] = prompt

    for _ in range(min(args.concurrency, requests)):
        admit()
    while live:
        for rid, tokens in list(live.items()):
            tokens.append(rng.randrange(1000, 40000))
            made = len(tokens) - args.prompt_len
            if kv.allocate_slots(rid, len(tokens), headroom_tokens=args.output_len - made) is None:
                raise SystemExit("bench/kv_placement.py: error: the pool is too small")
            kv.cache_blocks(rid, tokens, len(tokens) - 1)
            if made < args.output_len:
                continue
            table = kv.block_table(rid)
            # the shared first block is everyone's: count from the second on
            adjacent += sum(1 for a, b in zip(table[1:], table[2:], strict=False) if b == a + 1)
            pairs += len(table) - 2
            kv.free(rid)
            del live[rid]
            if started < requests:
                admit()
                if started == requests:
                    snapshot = [(kv.block_table(r), len(t) - 1) for r, t in live.items()]
    return adjacent / max(pairs, 1), snapshot


def layouts(
    tables: list[tuple[list[int], int]], num_blocks: int, seed: int
) -> tuple[dict[str, list[list[int]]], int]:
    """The same tables three ways, each in its own range of a pool's block ids: every table in
    contiguous blocks, the allocator's block ids (offset), and every block shuffled. Returns
    them and the pool size they need."""
    n = sum(len(t) for t, _ in tables)
    ids = list(range(n + num_blocks, 2 * n + num_blocks))
    random.Random(seed).shuffle(ids)
    contiguous, placed, shuffled = [], [], []
    at = 0
    for table, _ in tables:
        contiguous.append(list(range(at, at + len(table))))
        at += len(table)
        placed.append([n + b for b in table])
        shuffled.append([ids.pop() for _ in table])
    return {"contiguous": contiguous, "allocator": placed, "shuffled": shuffled}, 2 * n + num_blocks


def step_table(args: argparse.Namespace, tables: list[tuple[list[int], int]]) -> None:
    torch.set_num_threads(args.threads)
    tables_by_layout, pool_blocks = layouts(tables, args.num_blocks, args.seed)
    config = EngineConfig(
        load=LoadConfig(model=args.model, dtype=args.dtype),
        cache=CacheConfig(block_size=BLOCK, num_blocks=pool_blocks, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=len(tables), max_num_batched_tokens=4096),
    )
    runner = ModelRunner(config)
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    batches: dict[str, list[ScheduledSeq]] = {}
    for name, remapped in tables_by_layout.items():
        gen = torch.Generator().manual_seed(args.seed)
        batch = []
        for i, (table, (_, ctx)) in enumerate(zip(remapped, tables, strict=True)):
            prompt = torch.randint(1000, 40000, (ctx,), generator=gen).tolist()
            rid = f"{name}{i}"
            runner.run([ScheduledSeq(rid, prompt, 0, table, True, sp, prompt_token_ids=prompt)])
            batch.append(ScheduledSeq(rid, [5], ctx, table, True, sp, prompt))
        batches[name] = batch
    for batch in batches.values():
        for _ in range(3):
            runner.run(batch)
    ms: dict[str, list[float]] = {name: [] for name in batches}
    for _ in range(args.rounds):
        for name, batch in batches.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                runner.run(batch)
            ms[name].append((time.perf_counter() - t0) / args.steps * 1e3)
    ctxs = sorted({c for _, c in tables})
    print(f"\ndecode step: {args.model} {args.dtype}, {len(tables)} sequences at context "
          f"{'/'.join(map(str, ctxs))}, {args.threads} thread(s), {args.rounds} interleaved rounds "
          f"of {args.steps} steps")  # fmt: skip
    print("| tables | median ms | best ms | vs contiguous |")
    print("|---|---|---|---|")
    ref = statistics.median(ms["contiguous"])
    for name, vals in ms.items():
        med = statistics.median(vals)
        print(f"| {name} | {med:.1f} | {min(vals):.1f} | {med / ref:.3f}x |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    counts = [int(x) for x in args.requests.split(",")]
    print("| requests | blocks adjacent to their predecessor |")
    print("|---|---|")
    snapshot: list[tuple[list[int], int]] = []
    for count in counts:
        share, snapshot = place(args, count)
        print(f"| {count} | {share:.1%} |")
    if not args.no_step and snapshot:
        step_table(args, snapshot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
