"""Offline decode throughput of ``pdserve generate``'s engine against ``transformers`` generate.

For each dtype and batch size B, in one run on one machine, on the same weights:

* **pdserve**: ``OfflineEngine.generate`` (what ``pdserve generate`` runs) on B random
  ``--prompt-len``-token prompts, greedy, ``ignore_eos``, ``--new-tokens`` tokens each. Decode
  throughput = tokens produced by decode-only steps / their wall time (scheduling, forward over the
  paged KV cache and sampling included; prefill steps excluded).
* **transformers**: ``generate`` on the same GGUF (dequantised by transformers) and the same
  prompts, greedy, with ``max_new_tokens`` = 1 and 1 + S (S = new tokens - 1); the decode time is
  the difference, so the prefill cancels out; throughput = B * S / that time.

Each point is the best of ``--repeats`` runs, the two engines' runs interleaved so that both
see the same machine load (the machine may be shared). Prints a markdown table
for docs/benchmarks.md.

Usage::

    .venv/bin/python bench/offline_generate.py                         # smollm2, fp32 + bf16, B 1/16
    .venv/bin/python bench/offline_generate.py --dtypes bfloat16 --batch-sizes 1 --repeats 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from decode_worker.offline import OfflineEngine  # noqa: E402
from pdserve.config import CacheConfig, EngineConfig, LoadConfig, SchedulerConfig  # noqa: E402
from pdserve.model.resolve import resolve_model  # noqa: E402
from pdserve.sampling_params import SamplingParams  # noqa: E402


def _prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=gen).tolist()


def bench_pdserve(engine: OfflineEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of one generate call."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompts, params)
    return engine.stats.decode_tokens / engine.stats.decode_s


@torch.inference_mode()
def bench_transformers(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s: (generate 1 + S tokens) - (generate 1 token)."""
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        return time.perf_counter() - t0

    steps = new_tokens - 1
    return len(prompts) * steps / max(timed(1 + steps) - timed(1), 1e-9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    path = resolve_model(args.model).path
    rows = []
    for dtype in args.dtypes.split(","):
        blocks = max(batches) * -(-(args.prompt_len + args.new_tokens) // 16) + 8
        engine = OfflineEngine(
            EngineConfig(
                load=LoadConfig(model=args.model, dtype=dtype),
                cache=CacheConfig(block_size=16, num_blocks=blocks, enable_prefix_caching=False),
                scheduler=SchedulerConfig(max_num_batched_tokens=4096),
            )
        )
        hf = None
        if not args.no_hf:
            hf = AutoModelForCausalLM.from_pretrained(
                str(path.parent), gguf_file=path.name, dtype=getattr(torch, dtype)
            ).eval()
        vocab = engine.runner.model_config.vocab_size
        for b in batches:
            prompts = _prompts(b, args.prompt_len, vocab, seed=b)
            ours = ref = 0.0
            for _ in range(args.repeats):  # interleaved, so both see the same machine load
                ours = max(ours, bench_pdserve(engine, prompts, args.new_tokens))
                if hf is not None:
                    ref = max(ref, bench_transformers(hf, prompts, args.new_tokens))
            rows.append((dtype, b, ours, ref))
            print(f"# {dtype} B={b}: pdserve {ours:.1f} tok/s, transformers {ref:.1f} tok/s",
                  flush=True)  # fmt: skip
        del engine, hf
    print(
        f"\nOffline decode, {args.model}, prompt {args.prompt_len} tokens, {args.new_tokens} new "
        f"tokens, greedy, torch threads {torch.get_num_threads()}, best of {args.repeats}\n"
    )
    print("| dtype | batch | pdserve decode tok/s | transformers tok/s | ratio |")
    print("|---|---|---|---|---|")
    for dtype, b, ours, ref in rows:
        ratio = f"{ours / ref:.2f}x" if ref else "-"
        print(f"| {dtype} | {b} | {ours:.1f} | {ref:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
