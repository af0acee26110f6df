"""The suite's two workloads (issue 15), at full size and at ``--quick`` size, and their seeds.

- **main**: ``random`` prompts of 256 tokens, 128 output tokens (``ignore_eos``), 64 prompts at
  most 16 in flight, chat endpoint: plain throughput and TPOT.
- **mixed**: short requests (64 in / 128 out, 32 prompts, at most 8 in flight, completions
  endpoint, so TTFT and ITL count from the first token on every server) first alone, then again
  while a second client sends 1500-token prompts (8 out) at 0.25/s until the short run ends: how
  much long prefills stall short requests' decode (ITL) and queue their prefill (TTFT). Long
  prompts still unfinished ``long_drain_s`` after the short run ended are cut off and counted
  (a server that falls behind their rate would otherwise keep the suite waiting).

Every run on one server uses prompts of its own (a seed per run), because a server with prefix
caching answers a repeated prompt from its cache; the same run on different servers uses the same
prompts, so servers are compared on identical input.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.bench.client import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT

WORKLOADS = ("main", "mixed")

# Seed offsets (added to --seed) of the runs one server sees; each run's prompts are its own.
SEED_MAIN = 0
SEED_MAIN_PEER_CLIENT = 1  # vLLM's own client on the main workload
SEED_SHORT_ALONE = 2
SEED_SHORT_MIXED = 3
SEED_LONG = 1000  # long prompt i uses seed + SEED_LONG + i


@dataclass(frozen=True)
class MainWorkload:
    """Closed-loop random workload: lengths in tokens, ``max_concurrency`` requests in flight."""

    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 128
    max_concurrency: int = 16
    endpoint: str = CHAT_ENDPOINT

    def __post_init__(self) -> None:
        _positive(self, "num_prompts", "input_len", "output_len", "max_concurrency")


@dataclass(frozen=True)
class MixedWorkload:
    """Short closed-loop requests, alone and beside long prompts sent at ``long_rate`` per second.

    Lengths in tokens; the long client sends evenly spaced requests (no concurrency cap) from the
    moment the short run starts until it ends (or until it has sent ``long_num_prompts``, when
    > 0, so that a server that falls behind is not sent more long work than a faster one), then
    waits up to ``long_drain_s`` seconds for those in flight. A server that falls so far behind
    that the mixed short run takes more than ``mixed_cap_factor`` times as long as the short run
    alone (and over 120 s) has its mixed run cut off there and reported as failed, instead of
    holding the suite for as long as it takes.
    """

    short_num_prompts: int = 32
    short_input_len: int = 64
    short_output_len: int = 128
    short_max_concurrency: int = 8
    long_input_len: int = 1500
    long_output_len: int = 8
    long_rate: float = 0.25  # requests/s
    long_num_prompts: int = 0  # at most this many long prompts (0: until the short run ends)
    long_drain_s: float = 60.0
    mixed_cap_factor: float = 10.0
    endpoint: str = COMPLETIONS_ENDPOINT

    def __post_init__(self) -> None:
        _positive(
            self, "short_num_prompts", "short_input_len", "short_output_len",
            "short_max_concurrency", "long_input_len", "long_output_len", "long_rate",
            "long_drain_s", "mixed_cap_factor",
        )  # fmt: skip
        if self.long_num_prompts < 0:
            raise ValueError(
                f"MixedWorkload.long_num_prompts must be >= 0, got {self.long_num_prompts}"
            )

    def mixed_cap_s(self, alone_s: float) -> float:
        """The longest the mixed short run may take, given the short run alone took
        ``alone_s`` seconds."""
        return max(self.mixed_cap_factor * alone_s, MIN_MIXED_CAP_S)


MIN_MIXED_CAP_S = 120.0  # the mixed run's cap is never shorter (a fast short run alone)


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be > 0, got {value}")


FULL_MAIN = MainWorkload()
FULL_MIXED = MixedWorkload()
# --quick: a smoke run of every code path in a minute or two per server on SmolLM2.
QUICK_MAIN = MainWorkload(num_prompts=16, input_len=128, output_len=32, max_concurrency=8)
QUICK_MIXED = MixedWorkload(
    short_num_prompts=8, short_input_len=64, short_output_len=32, short_max_concurrency=4,
    long_input_len=512, long_output_len=8, long_rate=0.5, long_drain_s=30.0,
)  # fmt: skip


def client_flags(
    endpoint: str,
    input_len: int,
    output_len: int,
    num_prompts: int,
    max_concurrency: int,
    seed: int,
    num_warmups: int = 1,
) -> list[str]:
    """Flags of a closed-loop ``random`` run, spelled as both ``pdserve bench serve`` and
    ``vllm bench serve`` take them (ignore_eos, percentiles 50/90/99 of every metric)."""
    return [
        "--endpoint", endpoint, "--dataset-name", "random",
        "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(max_concurrency),
        "--ignore-eos", "--seed", str(seed), "--num-warmups", str(num_warmups),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
    ]  # fmt: skip


def main_flags(w: MainWorkload, seed: int) -> list[str]:
    """:func:`client_flags` of the main workload."""
    return client_flags(w.endpoint, w.input_len, w.output_len, w.num_prompts,
                        w.max_concurrency, seed)  # fmt: skip


def short_flags(w: MixedWorkload, seed: int, num_warmups: int = 1) -> list[str]:
    """:func:`client_flags` of the mixed workload's short requests."""
    return client_flags(w.endpoint, w.short_input_len, w.short_output_len, w.short_num_prompts,
                        w.short_max_concurrency, seed, num_warmups)  # fmt: skip


def workloads_for(quick: bool) -> tuple[MainWorkload, MixedWorkload]:
    """(main, mixed) at full or ``--quick`` size."""
    return (QUICK_MAIN, QUICK_MIXED) if quick else (FULL_MAIN, FULL_MIXED)
