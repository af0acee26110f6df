"""Sampler time per step: ``pdserve.sampling.Sampler`` on a decode batch's logits.

Times one ``Sampler.__call__`` on ``[--batch, --vocab]`` random logits in ``--dtype`` (SmolLM2's
vocabulary by default), unseeded and seeded rows (a generator per seeded row), temperature 1, no
truncation (what an OpenAI client gets by default), and prints the best-of-rounds median in ms.
Run it from two checkouts to compare samplers in one sitting::

    .venv/bin/python bench/sampler.py --threads 1
    PYTHONPATH=/path/to/other/checkout .venv/bin/python bench/sampler.py --threads 1

(``PYTHONPATH`` puts the other checkout's ``pdserve`` first; the script itself never imports
from its own directory.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import pdserve
from pdserve.engine.batch import ScheduledSeq
from pdserve.sampling import Sampler
from pdserve.sampling_params import SamplingParams


def rows(n: int, seeded: bool) -> list[ScheduledSeq]:
    """``n`` decode rows sampling at temperature 1 (seeded with their index when asked)."""
    return [
        ScheduledSeq(
            request_id=f"r{i}",
            token_ids=[0],
            num_computed=0,
            block_table=[0],
            sample=True,
            sampling=SamplingParams(temperature=1.0, seed=i if seeded else None),
            prompt_token_ids=[],
            output_token_ids=[],
        )
        for i in range(n)
    ]


def time_ms(sampler: Sampler, logits: torch.Tensor, seqs: list[ScheduledSeq], reps: int) -> float:
    """Median wall ms of one sampler call over ``reps`` calls (after 3 warm-up calls)."""
    for _ in range(3):
        sampler(logits, seqs)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        sampler(logits, seqs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--batch", type=int, default=16, help="rows (sequences) per step")
    ap.add_argument("--vocab", type=int, default=49152, help="logit columns (SmolLM2: 49152)")
    ap.add_argument("--dtype", default="bfloat16", help="logits dtype")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    ap.add_argument("--reps", type=int, default=30, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the best median is kept")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, generator=gen).to(getattr(torch, args.dtype))
    sampler = Sampler(args.vocab, seed=0)
    print(f"# pdserve from {pdserve.__file__}; torch threads {torch.get_num_threads()}")
    for seeded in (False, True):
        seqs = rows(args.batch, seeded)
        best = min(time_ms(sampler, logits, seqs, args.reps) for _ in range(args.rounds))
        what = "seeded" if seeded else "unseeded"
        print(f"{what}: {best:.2f} ms per call ({args.batch} x {args.vocab} {args.dtype})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
