"""How well a decode loop and a prefill loop overlap in one process (unified mode's prefill thread).

One ModelRunner (one set of weights, one KV pool) serves two Python threads, as in
``decode_worker/engine.py`` with ``--local-prefill-thread``: one repeats a decode step of
``--batch`` sequences at context ``--context``, the other a prefill forward of a
``--prompt-len``-token prompt, into disjoint KV blocks. Each loop runs alone first, then both
together, every thread on ``--threads`` intra-op threads (the model is compiled with that count, as
the worker does). Prints ms per step / forward and the combined efficiency: the sum of each loop's
rate together divided by its rate alone (2.0 = the two loops do not slow each other at all; the GIL,
shared caches and memory bandwidth take the rest).

    .venv/bin/python bench/prefill_thread_overlap.py --dtype bfloat16 --rounds 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig  # noqa: E402
from pdserve.engine.batch import ScheduledSeq  # noqa: E402
from pdserve.engine.runner import ModelRunner  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402


def time_loop(
    runner: ModelRunner, batch: list[ScheduledSeq], seconds: float, threads: int, out: list[float]
) -> None:
    """Run ``batch`` repeatedly for ``seconds``; append the mean ms per run to ``out``."""
    torch.set_num_threads(threads)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        runner.run(batch)
        n += 1
    out.append((time.perf_counter() - t0) / n * 1e3)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=16, help="decode sequences per step")
    p.add_argument("--context", type=int, default=300, help="decode context length (tokens)")
    p.add_argument("--prompt-len", type=int, default=256, help="prefill tokens per forward")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per loop")
    p.add_argument("--seconds", type=float, default=8.0, help="timing window per measurement")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--enforce-eager", action="store_true", help="do not compile the model")
    p.add_argument(
        "--switch-interval-ms", type=float, help="sys.setswitchinterval (Python's default: 5 ms)"
    )
    p.add_argument(
        "--processes", action="store_true", help="the two loops in two processes, not threads"
    )
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[ModelRunner, list[ScheduledSeq], list[ScheduledSeq]]:
    """The runner, the decode batch (its prompts already prefilled) and the prefill batch."""
    torch.set_num_threads(args.threads)  # before the compile: inductor keeps this count
    bs = 16
    per_seq = -(-(args.context + 1) // bs)
    pre_blocks = -(-args.prompt_len // bs)
    config = EngineConfig(
        load=LoadConfig(model=args.model, dtype=args.dtype, torch_compile=not args.enforce_eager),
        cache=CacheConfig(
            block_size=bs,
            num_blocks=args.batch * per_seq + pre_blocks + 8,
            enable_prefix_caching=False,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.batch,
            max_num_batched_tokens=max(4096, args.context, args.prompt_len),
        ),
    )
    runner = ModelRunner(config)
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    vocab = runner.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    decodes = []
    for i in range(args.batch):
        table = list(range(i * per_seq, (i + 1) * per_seq))
        prompt = torch.randint(0, vocab, (args.context,), generator=g).tolist()
        runner.run([ScheduledSeq(f"d{i}", prompt, 0, table, True, sp, prompt_token_ids=prompt)])
        decodes.append(ScheduledSeq(f"d{i}", [5], args.context, table, True, sp, prompt))
    base = args.batch * per_seq
    ptable = list(range(base, base + pre_blocks))
    pprompt = torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist()
    prefill = [ScheduledSeq("p", pprompt, 0, ptable, True, sp, prompt_token_ids=pprompt)]
    return runner, decodes, prefill


def report(r: int, d_alone: float, p_alone: float, d_both: float, p_both: float) -> None:
    eff = d_alone / d_both + p_alone / p_both
    print(
        f"round {r + 1}: alone decode {d_alone:.1f} ms/step, prefill {p_alone:.1f} "
        f"ms/forward; together {d_both:.1f} and {p_both:.1f}; combined efficiency "
        f"{eff:.2f} (2.0 = perfect)",
        flush=True,
    )


def run_threads(args: argparse.Namespace) -> None:
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    runner, decodes, prefill = build(args)
    print("# built", flush=True)
    for r in range(args.rounds):
        d_alone: list[float] = []
        p_alone: list[float] = []
        time_loop(runner, decodes, args.seconds, args.threads, d_alone)
        time_loop(runner, prefill, args.seconds, args.threads, p_alone)
        d_both: list[float] = []
        p_both: list[float] = []
        loops = [
            threading.Thread(
                target=time_loop, args=(runner, decodes, args.seconds, args.threads, d_both)
            ),
            threading.Thread(
                target=time_loop, args=(runner, prefill, args.seconds, args.threads, p_both)
            ),
        ]
        for t in loops:
            t.start()
        for t in loops:
            t.join()
        report(r, d_alone[0], p_alone[0], d_both[0], p_both[0])


def process_loop(args: argparse.Namespace, role: str, barrier: Any, results: Any) -> None:
    """One of the two processes: per round, its loop alone (while the other waits), then both."""
    runner, decodes, prefill = build(args)
    batch = decodes if role == "decode" else prefill
    for r in range(args.rounds):
        for phase in ("decode", "prefill", "both"):
            barrier.wait()
            if phase in (role, "both"):
                out: list[float] = []
                time_loop(runner, batch, args.seconds, args.threads, out)
                results.put((r, role, phase, out[0]))
            barrier.wait()


def run_processes(args: argparse.Namespace) -> None:
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [
        ctx.Process(target=process_loop, args=(args, role, barrier, results))
        for role in ("decode", "prefill")
    ]
    for p in procs:
        p.start()
    got: dict[tuple[int, str, str], float] = {}
    for _ in range(args.rounds * 4):
        r, role, phase, ms = results.get(timeout=1800)
        got[(r, role, phase)] = ms
        if (r, "decode", "both") in got and (r, "prefill", "both") in got:
            report(
                r,
                got[(r, "decode", "decode")],
                got[(r, "prefill", "prefill")],
                got[(r, "decode", "both")],
                got[(r, "prefill", "both")],
            )
    for p in procs:
        p.join()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    print(
        f"# {args.model} {args.dtype}, {args.threads} thread(s) per loop; decode batch "
        f"{args.batch} at context {args.context}; prefill {args.prompt_len} tokens; "
        f"{'two processes' if args.processes else 'two threads of one process'}",
        flush=True,
    )
    if args.processes:
        run_processes(args)
    else:
        run_threads(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
