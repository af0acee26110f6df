"""Greedy outputs with bf16 prefill attention on AMX tiles against the VDPBF16PS path.

SmolLM2-135M-Instruct in bf16, ``OfflineEngine.generate`` (what ``pdserve generate`` runs), one
thread, ``--num-prompts`` prompts of random token ids (20 to 900 tokens, seeded), greedy,
``--max-tokens`` new tokens each, once with ``set_prefill_amx(False)`` and once with it on
(the same engine and weights), then against ``transformers`` greedy generate in bf16. Prints how
many outputs are identical and, per prompt, the first token where they part (None: identical).
Random-token prompts give flat next-token distributions, so near-ties decide where bf16 paths
part. Exits 2 where the library runs no AMX path (no ``amx_bf16``, or the OS refuses tiles).

    .venv/bin/python bench/prefill_amx_greedy.py [--num-prompts 16 --max-tokens 64]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from decode_worker.offline import OfflineEngine  # noqa: E402
from pdserve.attention import cpu_kernels  # noqa: E402
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig  # noqa: E402
from pdserve.model.resolve import resolve_model  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ, None when they are equal."""
    if a == b:
        return None
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if not cpu_kernels.set_prefill_amx(True):
        print("no AMX prefill path here (CPU without amx_bf16, or tiles refused)")
        return 2
    blocks = args.num_prompts * -(-(900 + args.max_tokens) // 16) + 8
    engine = OfflineEngine(
        EngineConfig(
            load=LoadConfig(model="smollm2", dtype="bfloat16"),
            cache=CacheConfig(block_size=16, num_blocks=blocks, enable_prefix_caching=False),
            scheduler=SchedulerConfig(max_num_batched_tokens=4096),
        )
    )
    gen = torch.Generator().manual_seed(args.seed)
    lens = torch.randint(20, 900, (args.num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lens]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    outs: dict[str, list[list[int]]] = {}
    try:
        for name, on in (("vdpbf16ps", False), ("amx", True)):
            cpu_kernels.set_prefill_amx(on)
            outs[name] = [o.output_token_ids for o in engine.generate(prompts, params)]
    finally:
        cpu_kernels.set_prefill_amx(True)
    path = resolve_model("smollm2").path
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16
    ).eval()
    with torch.no_grad():
        outs["transformers"] = [
            hf.generate(torch.tensor([q]), max_new_tokens=args.max_tokens,
                        min_new_tokens=args.max_tokens, do_sample=False)[0, len(q):].tolist()
            for q in prompts
        ]  # fmt: skip
    for a, b in (("amx", "vdpbf16ps"), ("vdpbf16ps", "transformers"), ("amx", "transformers")):
        diffs = [first_difference(x, y) for x, y in zip(outs[a], outs[b], strict=True)]
        same = sum(d is None for d in diffs)
        print(f"{a} vs {b}: {same} of {len(prompts)} identical; first difference {diffs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
