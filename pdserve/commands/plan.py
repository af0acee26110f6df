"""`pdserve plan`: KV cache bytes for a config.json (seed formula) and the concurrency it admits."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pdserve.config import ConfigError
from pdserve.plan import format_plan, load_model_config, plan_kv


def register(subparsers: Any) -> None:
    """Add the ``plan`` subcommand."""
    p = subparsers.add_parser(
        "plan",
        help="KV cache capacity planner",
        description="Print the KV cache size of a model (2 * layers * kv_heads * head_dim * "
        "bytes * tokens * batch) and, with --memory-gib, how many sequences fit at once.",
    )
    p.add_argument(
        "--config",
        required=True,
        help="Hugging Face config.json (or its directory), a .gguf file, or smollm2",
    )
    p.add_argument("--tokens", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="number of sequences (default 1)")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        help="KV cache dtype: float32|bfloat16|float16 (or fp32|bf16|fp16; default bfloat16; "
        "pdserve serve --dtype auto runs float32 on CPUs without fast bf16: pass that to size it)",
    )
    p.add_argument("--memory-gib", type=float, default=None, help="KV cache budget in GiB")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print the plan; one-line error and exit status 2 on bad input."""
    try:
        model = load_model_config(args.config)
        plan = plan_kv(
            model,
            tokens=args.tokens,
            batch=args.batch,
            dtype=args.dtype,
            memory_gib=args.memory_gib,
            block_size=args.block_size,
        )
    except ConfigError as e:
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    return 0
