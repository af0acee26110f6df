"""Serving suite (issue 15): pdserve in both modes, and vLLM beside it, on one machine in one run.

Measures the machine's matmul rate and copy bandwidth in the served dtype, starts each server in
turn on loopback (``pdserve serve --mode disaggregated | unified``; with ``--with-vllm`` first the
vLLM peer), runs the main workload (random 256 in / 128 out, 64 prompts, concurrency 16, chat,
``ignore_eos``) and the mixed workload (short requests alone, then beside 1500-token prompts at
0.25/s), and writes per-run result JSON, charts (``pdserve bench plot``), ``summary.json`` and a
markdown ``report.md`` into ``--result-dir`` (default ``bench-results/<timestamp>/``). Each run's
duration is set against its arithmetic and memory floors (:mod:`pdserve.bench.floors`).

Usage::

    make bench                                            # pdserve's side, both modes
    make bench BENCH_ARGS="--quick"                       # smoke run, small counts
    .venv/bin/python bench/serving_suite.py --with-vllm   # side by side with the vLLM peer

See docs/bench.md ("The serving suite"). Exit status: 0, 1 when a server or run failed (the
report says which), 2 for bad arguments or a missing peer script.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve.bench.suite.runner import MODES, SuiteConfig, run_suite  # noqa: E402
from pdserve.bench.suite.servers import REPO_ROOT  # noqa: E402
from pdserve.bench.suite.vllm_peer import DEFAULT_PEER, PEER_ENV, PeerError, VllmPeer  # noqa: E402
from pdserve.bench.suite.workloads import WORKLOADS  # noqa: E402


def _choices(allowed: tuple[str, ...], flag: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"{flag}: {', '.join(bad)} not in {', '.join(allowed)}"
            )
        return items

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2", help="model both servers serve")
    p.add_argument(
        "--load-format", default="auto", help="pdserve --load-format (dummy: random weights)"
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer that builds prompts (default: --model)"
    )
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (what pdserve serve picks: bfloat16 with AMX or AMD's avx512_bf16, else float32) | float32 | "
        "bfloat16; the same dtype for every server",
    )
    p.add_argument(
        "--modes", type=_choices(MODES, "--modes"), default=MODES, help="pdserve modes to run"
    )
    p.add_argument(
        "--workloads", type=_choices(WORKLOADS, "--workloads"), default=WORKLOADS,
        help="workloads to run",
    )  # fmt: skip
    p.add_argument(
        "--mixed-modes", type=_choices(MODES, "--mixed-modes"), default=("disaggregated",),
        help="pdserve modes that also run the mixed workload",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="small counts: a smoke run")
    p.add_argument(
        "--with-vllm", action="store_true",
        help="also start the vLLM peer and run every workload against it, and vLLM's own "
        "client on the main workload against every server",
    )  # fmt: skip
    p.add_argument(
        "--vllm-peer", default=None,
        help=f"the peer script (default: ${PEER_ENV}, else {DEFAULT_PEER} from the repo root)",
    )  # fmt: skip
    p.add_argument(
        "--result-dir", type=Path, default=None,
        help="where results go (default bench-results/<timestamp>/ in the repo root)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seeds every run's prompts")
    p.add_argument(
        "--long-num-prompts", type=int, default=0,
        help="the mixed run's long client stops after this many prompts (0: it sends until the "
        "short run ends), so a server that falls behind gets no more long work than a faster one",
    )  # fmt: skip
    p.add_argument(
        "--serve-arg", action="append", default=[], metavar="ARG",
        help="extra `pdserve serve` argument (repeat; e.g. --serve-arg=--max-num-seqs=32)",
    )  # fmt: skip
    p.add_argument(
        "--ready-timeout", type=float, default=600.0, help="seconds a server may take to start"
    )
    p.add_argument(
        "--request-timeout", type=float, default=1800.0, help="seconds one request may take"
    )
    return p.parse_args(argv)


# flags whose value goes to the SuiteConfig field of the same name
SAME_NAMES = ("model", "load_format", "tokenizer", "modes", "workloads", "mixed_modes", "quick",
              "seed", "long_num_prompts")  # fmt: skip


def resolve_dtype(dtype: str, model: str) -> str:
    """'auto' -> the dtype ``pdserve serve --dtype auto`` would pick on this machine."""
    if dtype != "auto":
        return dtype
    from pdserve.config import LoadConfig

    return LoadConfig(model=model, device="cpu").resolved_dtype


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    peer = None
    if args.with_vllm:
        try:
            peer = VllmPeer.locate(args.vllm_peer, REPO_ROOT)
        except PeerError as e:
            print(f"serving_suite: error: {e}", file=sys.stderr)
            return 2
    out = args.result_dir or REPO_ROOT / "bench-results" / time.strftime("%Y%m%d-%H%M%S")
    try:
        config = SuiteConfig(
            out_dir=Path(out),
            dtype=resolve_dtype(args.dtype, args.model),
            peer=peer,
            serve_args=tuple(args.serve_arg),
            ready_timeout_s=args.ready_timeout,
            request_timeout_s=args.request_timeout,
            **{name: getattr(args, name) for name in SAME_NAMES},
        )
    except ValueError as e:
        print(f"serving_suite: error: {e}", file=sys.stderr)
        return 2
    report, errors = run_suite(config, echo=lambda line: print(line, flush=True))
    print(report.read_text())
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
