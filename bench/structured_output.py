"""Cost of structured output (issue 13): decode tokens/s with a grammar mask vs without, and
schema compile time.

A batch of ``--batch`` sequences (SmolLM2 by default) is prefilled once by the ModelRunner, then
``--steps`` decode steps are timed with every row under a JSON-schema grammar (an array of nested
objects with enums, numbers and strings, long enough that no row completes it within the run) and
again with no constraint; sampling is seeded (temperature 0.8) and identical otherwise. Step time
is the median wall time of ``ModelRunner.run`` (forward + sampling; with the schema, the bitmask
fill over all rows, its application and the matcher advance are included); the sampling part is
timed on its own too, since the mask's whole cost lives there. The two cases run interleaved
``--repeats`` times and each figure is the best (the machine may be shared). Compile time: a fresh
compiler's first compile of the schema (cold), then a cached lookup.

Usage::

    .venv/bin/python bench/structured_output.py                # smollm2, batch 16, 48 steps
    .venv/bin/python bench/structured_output.py --batch 8 --steps 32 --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pdserve.config import CacheConfig, EngineConfig, LoadConfig
from pdserve.engine.batch import ScheduledSeq
from pdserve.engine.runner import ModelRunner
from pdserve.sampling_params import SamplingParams
from pdserve.structured.grammar import GrammarCompiler
from pdserve.structured.spec import StructuredOutputSpec
from pdserve.tokenizer import load_tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height_m": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "height_m", "role", "tags", "address"],
}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 32}


class _TimedSampler:
    """The runner's sampler, timing each call (seconds appended to ``times``)."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.times: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sampler, name)

    def __call__(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = self.sampler(*args)
        self.times.append(time.perf_counter() - t0)
        return out


def _run(
    runner: ModelRunner,
    prompts: list[list[int]],
    spec: StructuredOutputSpec | None,
    compiler: GrammarCompiler,
    steps: int,
) -> tuple[float, float]:
    """Median seconds per decode step of the whole batch, and of its sampling alone."""
    bs = runner.block_size
    per_seq = -(-(max(len(p) for p in prompts) + steps + 1) // bs)
    seqs = []
    for i, p in enumerate(prompts):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=steps + 1, structured=spec)
        table = list(range(i * per_seq, (i + 1) * per_seq))
        seqs.append(
            ScheduledSeq(
                f"r{i}", list(p), 0, table, True, params, prompt_token_ids=list(p),
                grammar=compiler.matcher(spec) if spec is not None else None,
            )
        )  # fmt: skip
    first = runner.run(seqs).tokens  # prefill: token 1 (sampled under the grammar too)
    for s, t in zip(seqs, first, strict=True):
        assert t is not None
        s.num_computed, s.token_ids = len(s.prompt_token_ids), [t.token_id]
        s.output_token_ids.append(t.token_id)
    times = []
    timed = _TimedSampler(runner.sampler)
    runner.sampler = timed  # type: ignore[assignment]
    for _ in range(steps):
        t0 = time.perf_counter()
        out = runner.run(seqs).tokens
        times.append(time.perf_counter() - t0)
        for s, t in zip(seqs, out, strict=True):
            assert t is not None
            s.num_computed += 1
            s.token_ids = [t.token_id]
            s.output_token_ids.append(t.token_id)
    runner.sampler = timed.sampler
    if spec is not None:
        done = [s.grammar.is_terminated for s in seqs if s.grammar is not None]
        assert not any(done), "a row completed the schema: raise minItems"
    return statistics.median(times), statistics.median(timed.times)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2, help="best of this many runs per case")
    args = ap.parse_args()
    torch.manual_seed(0)

    tok = load_tokenizer(args.model)
    cfg = EngineConfig(
        load=LoadConfig(model=args.model, dtype=args.dtype),
        cache=CacheConfig(block_size=16, num_blocks=args.batch * 8 + 8),
    )
    runner = ModelRunner(cfg, None)
    mc = runner.model_config
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": f"List people as JSON ({i})."}])
        for i in range(args.batch)
    ]
    spec = StructuredOutputSpec.json_schema(SCHEMA, "response_format")

    t0 = time.perf_counter()
    compiler = GrammarCompiler(tok.hf, mc.vocab_size, mc.eos_token_ids or tok.eos_token_ids)
    wrap_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(spec)
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(spec)
    hot_s = time.perf_counter() - t0

    _run(runner, prompts, None, compiler, 4)  # warm-up
    runs: dict[str, list[tuple[float, float]]] = {"free": [], "masked": []}
    for _ in range(args.repeats):  # interleaved, so a busy spell hits both cases alike
        runs["free"].append(_run(runner, prompts, None, compiler, args.steps))
        runs["masked"].append(_run(runner, prompts, spec, compiler, args.steps))
    free, free_s = (min(x) for x in zip(*runs["free"], strict=True))
    masked, masked_s = (min(x) for x in zip(*runs["masked"], strict=True))
    b = args.batch
    print(f"model {args.model}, dtype {cfg.load.resolved_dtype}, batch {b}, {args.steps} steps, "
          f"torch threads {torch.get_num_threads()}")  # fmt: skip
    print("| case | step ms (median) | of which sampling ms | tokens/s |")
    print("|---|---:|---:|---:|")
    print(f"| no schema | {free * 1e3:.1f} | {free_s * 1e3:.2f} | {b / free:.1f} |")
    print(
        f"| JSON schema (bitmask) | {masked * 1e3:.1f} | {masked_s * 1e3:.2f} | {b / masked:.1f} |"
    )
    print(
        f"mask cost: {(masked / free - 1) * 100:+.1f}% step time; sampling +"
        f"{(masked_s - free_s) * 1e3:.2f} ms = {(masked_s - free_s) / free * 100:.1f}% of a step"
    )
    print(f"tokenizer wrap {wrap_s * 1e3:.0f} ms (once per process); schema compile cold "
          f"{cold_s * 1e3:.1f} ms, cached {hot_s * 1e6:.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()
