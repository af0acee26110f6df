"""`pdserve generate`: offline batched generation in this process (no Ray, no servers).

Every ``--prompt`` is tokenized (through the model's chat template with ``--chat``), all prompts
run together in one OfflineEngine (the decode worker's scheduler in unified mode), and each
completion is printed to stdout; with several prompts each completion is preceded by a
``=== [i] ===`` line. A timing summary goes to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from pdserve.config import CacheConfig, ConfigError, EngineConfig, LoadConfig, SchedulerConfig
from pdserve.engine.errors import EngineError
from pdserve.sampling_params import SamplingError, SamplingParams


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` subcommand."""
    p = subparsers.add_parser(
        "generate",
        help="offline batched generation on one process",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--model", default="smollm2", help="'smollm2', a .gguf file or a HF directory")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument(
        "--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto|float32|bfloat16|float16 (auto: bfloat16 on CUDA and on CPUs where bf16 beats fp32, else float32)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--attention-backend",
        default="auto",
        help="auto (triton on CUDA, cpu_paged on CPU) | torch_ref | cpu_paged | triton",
    )
    p.add_argument("--load-format", default="auto", help="auto|safetensors|gguf|dummy")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.set_defaults(func=run)


class _StderrNow(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler that writes to whatever ``sys.stderr`` is at each record."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def show_kernel_builds() -> None:
    """Say on stderr when a CPU kernel is compiled for this machine (its first use: tens of
    seconds in all, which would otherwise pass in silence; cached afterwards)."""
    build_log = logging.getLogger("pdserve.attention.cpu_build")
    if not any(isinstance(h, _StderrNow) for h in build_log.handlers):
        handler = _StderrNow()
        handler.setFormatter(logging.Formatter("[pdserve] %(message)s"))
        handler.setLevel(logging.INFO)
        build_log.addHandler(handler)
    if build_log.getEffectiveLevel() > logging.INFO:
        build_log.setLevel(logging.INFO)


def run(args: argparse.Namespace) -> int:
    """Generate and print. Returns 0, or 2 after printing one error line for bad input."""
    show_kernel_builds()
    try:
        return _run(args)
    except (ConfigError, EngineError, SamplingError, ValueError) as e:
        print(f"pdserve generate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    # heavy imports here, so `pdserve --help` stays fast
    from decode_worker.offline import OfflineEngine
    from pdserve.attention.selector import select_attention_backend
    from pdserve.model.loader import load_model_config
    from pdserve.tokenizer import load_tokenizer

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
    )
    load = LoadConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
    )
    # model and backend problems first, one line, before the tokenizer is read
    model = load_model_config(load)
    select_attention_backend(load.attention_backend, load.device, model.head_dim)
    tok = load_tokenizer(args.model)
    if args.chat:
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in args.prompt]
    else:
        prompts = [tok.encode(p) for p in args.prompt]
    # exactly the blocks these requests can ever need: nothing is preempted, nothing is wasted
    need = sum(-(-(len(p) + args.max_tokens) // args.block_size) for p in prompts)
    cache = CacheConfig(block_size=args.block_size, num_blocks=need + len(prompts))
    sched = SchedulerConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
    )
    engine = OfflineEngine(
        EngineConfig(load=load, cache=cache, scheduler=sched), eos_token_ids=tok.eos_token_ids
    )
    outputs = engine.generate(prompts, params)
    for i, out in enumerate(outputs):
        if len(outputs) > 1:
            print(f"=== [{i}] ===")
        print(tok.decode(out.output_token_ids, skip_special_tokens=True))
    sys.stdout.flush()
    st = engine.stats
    generated = sum(len(o.output_token_ids) for o in outputs)
    decode_rate = st.decode_tokens / st.decode_s if st.decode_s else 0.0
    print(
        f"[{len(outputs)} prompts, {st.prefill_tokens} prefill tokens, {generated} generated in "
        f"{st.wall_s:.2f} s; decode {decode_rate:.1f} tok/s; dtype {load.resolved_dtype}]",
        file=sys.stderr,
    )
    return 0
