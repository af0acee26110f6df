"""Command-line flags of `pdserve serve` and `pdserve router`, in argparse groups.

Flag names follow vLLM's ``vllm serve`` where the concept is the same. Every default is read from
the config dataclass the flag fills (pdserve/config.py), so a default lives in one place.
"""

from __future__ import annotations

import argparse

from pdserve import env
from pdserve.config import (
    CPU_MAX_LOCAL_PREFILL_LENGTH,
    CPU_PREFILL_NICENESS,
    CacheConfig,
    LoadConfig,
    SchedulerConfig,
    ServeConfig,
    TransferConfig,
)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --served-model-name, --max-model-len."""
    p.add_argument(
        "--model", default=LoadConfig.model, help="'smollm2' (bundled), a .gguf file or a HF dir"
    )
    p.add_argument(
        "--served-model-name", default=None, help="model id clients use (default: --model's name)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + output tokens per request (default: the model's context length)",
    )


def add_fault_args(p: argparse.ArgumentParser) -> None:
    """--enable-fault-injection (reliability drills; never in production)."""
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="let POST /admin/faults arm worker faults (kill at a phase, stall/corrupt a KV "
        "transfer, drop aborts, delay GetStats); KV payloads are then always checksummed",
    )


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    """Gateways, auth and admission flags, and the router's placement flags."""
    g = p.add_argument_group("gateways")
    g.add_argument("--host", default=ServeConfig.host, help="address both gateways listen on")
    g.add_argument("--port", type=int, default=ServeConfig.port, help="HTTP (OpenAI API) port")
    g.add_argument(
        "--grpc-port", type=int, default=ServeConfig.grpc_port, help="gRPC (pdserve.v1) port"
    )
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${env.API_KEY} if set)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=ServeConfig.max_queued_requests,
        help="requests waiting for their first token before new ones get HTTP 429",
    )
    g.add_argument(
        "--max-queued-tokens",
        type=int,
        default=ServeConfig.max_queued_tokens,
        help="prompt tokens waiting for their first token before new requests get HTTP 429",
    )
    g.add_argument(
        "--max-concurrent-streams",
        type=int,
        default=ServeConfig.max_concurrent_streams,
        help="open streaming (SSE) responses before new streaming requests get HTTP 429",
    )
    g.add_argument(
        "--log-prompts",
        action="store_true",
        help="log prompt and output texts (user data: off by default, never logged otherwise)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=ServeConfig.request_timeout_s,
        help="seconds before a request is aborted",
    )
    g.add_argument(
        "--drain-timeout",
        type=float,
        default=ServeConfig.drain_timeout_s,
        help="seconds a stopping router (SIGTERM, Ctrl-C) lets requests in flight finish; the "
        "rest, or all at a second signal, end with a 503 'shutting down' (0: at once)",
    )
    g.add_argument(
        "--chat-template",
        default=ServeConfig.chat_template,
        help="chat template (a Jinja file, or the template itself) used instead of the model's",
    )
    g.add_argument(
        "--tool-call-parser",
        default=ServeConfig.tool_call_parser,
        choices=["auto", "hermes", "json"],
        help="how tool calls are read from chat output (default: hermes when the chat template "
        "uses <tool_call>, else json)",
    )
    g.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help=f"log level (default: ${env.LOG_LEVEL} or info)",
    )
    g = p.add_argument_group("placement (router)")
    g.add_argument(
        "--max-local-prefill-length",
        type=int,
        default=None,
        help="conditional disaggregation: prompts of at most this many tokens are prefilled on "
        "their decode worker while every prefill worker is backlogged and the local prefills in "
        "flight there, this one included, total at most this many tokens or, when longer, the "
        "backlog it would wait behind (0 = off; default: "
        f"{CPU_MAX_LOCAL_PREFILL_LENGTH} when the decode workers run on CPUs, else 0)",
    )
    g.add_argument(
        "--min-prefill-queue-tokens",
        type=int,
        default=ServeConfig.min_prefill_queue_tokens,
        help="the backlog at which --max-local-prefill-length applies: prompt tokens the prompt "
        "would wait behind on every prefill worker (for a prompt the prefill scheduler classes "
        "short, only the short prompts queued there; else the whole queue)",
    )


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Per-worker engine flags (vLLM names)."""
    g = p.add_argument_group("engine (every worker)")
    g.add_argument(
        "--load-format", default=LoadConfig.load_format, help="auto | safetensors | gguf | dummy"
    )
    g.add_argument(
        "--dtype",
        default=LoadConfig.dtype,
        help="auto (bfloat16 on CUDA and on CPUs where bf16 beats fp32: AMX, or avx512_bf16 on AMD; else float32) | float32 | "
        "bfloat16 | float16",
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument(
        "--attention-backend",
        default=LoadConfig.attention_backend,
        help="auto (triton on CUDA, cpu_paged on CPU) | torch_ref | cpu_paged | triton",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model eagerly: skip compiling it with torch.compile at worker startup "
        "(CPU; compiling takes from seconds, with inductor's on-disk cache warm, to minutes)",
    )
    g.add_argument(
        "--seed", type=int, default=LoadConfig.seed, help="seed of --load-format dummy weights"
    )
    g.add_argument(
        "--block-size", type=int, default=CacheConfig.block_size, help="KV block size in tokens"
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=CacheConfig.kv_cache_memory_bytes,
        help="KV cache size of each worker, in bytes",
    )
    g.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=CacheConfig.num_blocks,
        help="KV blocks per worker (overrides --kv-cache-memory-bytes; CPU too)",
    )
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=SchedulerConfig.max_num_seqs,
        help="sequences per step",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.max_num_batched_tokens,
        help="tokens computed per step (prefill workers: see --prefill-max-num-batched-tokens)",
    )
    g.add_argument(
        "--prefill-max-num-batched-tokens",
        type=int,
        default=SchedulerConfig.prefill_max_num_batched_tokens,
        help="tokens computed per step on prefill workers and unified mode's prefill thread "
        "(0 = automatic: on a CPU at most 320, "
        "where bigger prefill batches cost as much per token and only make every prompt of a "
        "burst wait for the whole batch; elsewhere --max-num-batched-tokens)",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=SchedulerConfig.long_prefill_token_threshold,
        help="prompts with more tokens than this to compute are long: on a prefill worker they "
        "share at most this many tokens of a step, so short prompts never wait for a whole long "
        "one; the share is capped at a prefill worker's step (0 = automatic: "
        "--max-num-batched-tokens // 8 "
        "on prefill workers; // 2 for a decode worker's local prefills)",
    )
    g.add_argument(
        "--local-prefill-thread",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a decode worker computes its local prompts (unified mode, or conditional "
        "disaggregation) on a thread of their own, concurrently with the decode steps, each on "
        "half of the worker's threads, instead of as chunks inside the decode steps (default: on "
        "in unified mode where a worker has 2 or more threads, and for CPU decode workers with "
        "--max-local-prefill-length > 0 in disaggregated mode)",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=CacheConfig.enable_prefix_caching,
        help="reuse KV blocks of shared prompt prefixes",
    )
    g.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=TransferConfig.timeout_s,
        help="seconds per KV send/receive",
    )


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    """Workers and Ray."""
    g = p.add_argument_group("cluster")
    g.add_argument(
        "--mode",
        default=ServeConfig.mode,
        choices=["disaggregated", "unified"],
        help="unified = no prefill workers; decode workers prefill locally",
    )
    g.add_argument(
        "--num-prefill-workers",
        type=int,
        default=None,
        help="prefill worker actors (0: the decode workers prefill locally); default "
        f"{ServeConfig.num_prefill_workers}, and none with --mode unified",
    )
    g.add_argument(
        "--num-decode-workers",
        type=int,
        default=ServeConfig.num_decode_workers,
        help="decode worker actors (>= 1); default %(default)s",
    )
    g.add_argument(
        "--cpus-per-worker",
        type=float,
        default=None,
        help="Ray CPUs (and torch threads, rounded) per worker (default: the machine's CPUs "
        "split evenly among the workers)",
    )
    g.add_argument(
        "--prefill-niceness",
        type=int,
        default=None,
        help="the niceness (0-19) of the prefill workers' threads, so that decode steps win "
        "the CPU time the roles contend for where they share cores (default: "
        f"{CPU_PREFILL_NICENESS} for CPU workers, else 0)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help=f"join this Ray cluster (default: ${env.RAY_ADDRESS}, else start a local one)",
    )


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except None (the help text says what None means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)
