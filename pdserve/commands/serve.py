"""`pdserve serve`: the whole system on one machine (DESIGN §8).

Starts (or joins, ``--ray-address``) a Ray cluster, launches ``--num-prefill-workers`` prefill and
``--num-decode-workers`` decode actors, and serves the OpenAI HTTP API (``--port``, default 8000)
and the gRPC API (``--grpc-port``, default 50051) through one router. Flag names follow vLLM's
``vllm serve`` where the concept is the same. ``--mode unified`` runs no prefill worker: decode
workers prefill locally (the baseline for differential tests).

Startup order: validate flags and read the model config (no weights) -> bind both ports -> start
Ray and the workers (each loads the weights; a tqdm bar of workers loaded on a terminal, progress
lines otherwise) -> print where to connect. Ctrl-C (or SIGTERM) stops the gateways, then the
workers, then Ray.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pdserve import env
from pdserve.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    SchedulerConfig,
    ServeConfig,
    TransferConfig,
)

log = logging.getLogger("pdserve.serve")


# -- flags shared with `pdserve router` -----------------------------------------------------------


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --served-model-name, --max-model-len."""
    p.add_argument(
        "--model", default="smollm2", help="'smollm2' (bundled), a .gguf file or a HF dir"
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


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    """Gateways, auth and admission flags."""
    g = p.add_argument_group("gateways")
    g.add_argument("--host", default="0.0.0.0", help="address both gateways listen on")
    g.add_argument("--port", type=int, default=8000, help="HTTP (OpenAI API) port")
    g.add_argument("--grpc-port", type=int, default=50051, help="gRPC (pdserve.v1) port")
    g.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' (default: ${env.API_KEY} if set)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=256,
        help="requests waiting for their first token before new ones get HTTP 429",
    )
    g.add_argument(
        "--max-queued-tokens",
        type=int,
        default=262144,
        help="prompt tokens waiting for their first token before new requests get HTTP 429",
    )
    g.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds before a request is aborted"
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="chat template (a Jinja file, or the template itself) used instead of the model's",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
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


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Per-worker engine flags (vLLM names)."""
    g = p.add_argument_group("engine (every worker)")
    g.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    g.add_argument(
        "--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA) | float32 | ..."
    )
    g.add_argument("--device", default="auto", help="auto | cpu | cuda")
    g.add_argument("--seed", type=int, default=0, help="seed of --load-format dummy weights")
    g.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=CacheConfig.kv_cache_memory_bytes,
        help="KV cache size of each worker, in bytes",
    )
    g.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=0,
        help="KV blocks per worker (overrides --kv-cache-memory-bytes; CPU too)",
    )
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences per step")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens computed per step"
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of shared prompt prefixes",
    )
    g.add_argument(
        "--kv-transfer-timeout", type=float, default=30.0, help="seconds per KV send/receive"
    )


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument(
        "--mode",
        default="disaggregated",
        choices=["disaggregated", "unified"],
        help="unified = no prefill workers; decode workers prefill locally",
    )
    g.add_argument("--num-prefill-workers", type=int, default=1)
    g.add_argument("--num-decode-workers", type=int, default=1)
    g.add_argument(
        "--cpus-per-worker",
        type=float,
        default=None,
        help="Ray CPUs (and torch threads) per worker (default: the CPUs split evenly)",
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


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve",
        help="run the whole system: Ray workers + HTTP and gRPC gateways",
        description="Start Ray prefill/decode workers and serve the OpenAI HTTP API and the "
        "gRPC API in front of them.",
        formatter_class=HelpFormatter,
    )
    add_model_args(p)
    add_cluster_args(p)
    add_engine_args(p)
    add_frontend_args(p)
    p.set_defaults(func=run)


# -- configuration ----------------------------------------------------------------------------------


def setup_logging(level_name: str | None) -> None:
    """Log to stderr at ``level_name`` (or PDSERVE_LOG_LEVEL, default INFO)."""
    level = logging.getLevelName(level_name.upper()) if level_name else env.log_level()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("httpx", "ray", "filelock", "urllib3"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'. Raises ConfigError for other values."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not device.startswith("cuda"):
        raise ConfigError(f"--device {device!r} is not auto, cpu or cuda")
    return device


def resolve_max_model_len(requested: int | None, model: ModelConfig) -> int:
    """The model's context length, or ``requested`` if not larger. Raises ConfigError."""
    limit = model.max_position_embeddings
    if requested is None:
        return limit
    if requested < 2:
        raise ConfigError(f"--max-model-len must be >= 2, got {requested}")
    if requested > limit:
        raise ConfigError(
            f"--max-model-len {requested} exceeds the model's context length ({limit} tokens)"
        )
    return requested


@dataclass(frozen=True)
class ServePlan:
    """Everything `pdserve serve` derived from its flags."""

    serve: ServeConfig
    model: ModelConfig
    model_name: str
    max_model_len: int
    cpus_per_worker: float | None
    log_level: str


def build_plan(args: argparse.Namespace) -> ServePlan:
    """Validate flags and read the model config (no weights). Raises ConfigError naming the flag."""
    from pdserve.model.loader import load_model_config
    from pdserve.model.resolve import resolve_model
    from pdserve.tokenizer import load_chat_template

    load = LoadConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=resolve_device(args.device),
        seed=args.seed,
    )
    model = load_model_config(load)
    max_model_len = resolve_max_model_len(args.max_model_len, model)
    cache = CacheConfig(
        block_size=args.block_size,
        num_blocks=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    capacity = cache.blocks_for(model, load.resolved_dtype) * cache.block_size
    if capacity < max_model_len:
        raise ConfigError(
            f"each worker's KV cache holds {capacity} tokens, less than --max-model-len "
            f"{max_model_len}; raise --kv-cache-memory-bytes or lower --max-model-len"
        )
    engine = EngineConfig(
        load=load,
        cache=cache,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
        ),
        transfer=TransferConfig(timeout_s=args.kv_transfer_timeout),
    )
    unified = args.mode == "unified"
    serve = ServeConfig(
        engine=engine,
        mode=args.mode,
        num_prefill_workers=0 if unified else args.num_prefill_workers,
        num_decode_workers=args.num_decode_workers,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        ray_address=args.ray_address or env.ray_address(),
        api_key=args.api_key or env.api_key(),
        served_model_name=args.served_model_name,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        request_timeout_s=args.request_timeout,
        chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
        tool_call_parser=args.tool_call_parser,
    )
    name = args.served_model_name or resolve_model(args.model).name
    return ServePlan(
        serve, model, name, max_model_len, args.cpus_per_worker, args.log_level or "info"
    )


# -- running ----------------------------------------------------------------------------------------


def say(line: str) -> None:
    """One progress line on stdout, flushed (startup happens before logging is interesting)."""
    print(f"[pdserve] {line}", flush=True)


def print_ready(urls: dict[str, str], plan: ServePlan, api_key: bool) -> None:
    s = plan.serve
    workers = (
        f"{s.num_decode_workers} decode worker(s), local prefill"
        if s.mode == "unified"
        else f"{s.num_prefill_workers} prefill + {s.num_decode_workers} decode workers"
    )
    auth = ' -H "Authorization: Bearer $PDSERVE_API_KEY"' if api_key else ""
    lines = [
        f"ready: model '{plan.model_name}' ({s.mode}: {workers}, max_model_len "
        f"{plan.max_model_len})",
        f"  OpenAI API  {urls['openai']}   (try: curl{auth} {urls['openai']}/models)",
        f"  gRPC API    {urls['grpc']}   (pdserve.v1.Generation, grpc.health.v1, reflection)",
        f"  metrics     {urls['metrics']}   health {urls['health']}",
        "  Ctrl-C to stop",
    ]
    for line in lines:
        say(line)


class StartupProgress:
    """Startup display on stderr: a live tqdm bar of workers loaded, with elapsed time, when
    stderr is a terminal; otherwise (logs, CI) a "still starting" line every ``every_s`` seconds.

    ``line()`` prints a progress line without tearing the bar.
    """

    def __init__(self, num_workers: int, label: str, every_s: float = 10.0) -> None:
        from tqdm import tqdm

        self.label = label
        self.every_s = every_s
        self._t0 = time.monotonic()
        self._bar = tqdm(
            total=num_workers,
            desc=f"[pdserve] {label}",
            unit="worker",
            file=sys.stderr,
            disable=None,  # only on a terminal
            dynamic_ncols=True,
            bar_format="{desc}: {n_fmt}/{total_fmt} workers loaded |{bar}| {elapsed}",
        )
        self._task: asyncio.Task[None] | None = None

    @property
    def live(self) -> bool:
        """True when the bar is drawn (stderr is a terminal)."""
        return not self._bar.disable

    def line(self, text: str) -> None:
        if self.live:
            self._bar.write(f"[pdserve] {text}", file=sys.stdout)
        else:
            say(text)

    def worker_ready(self, _info: object = None) -> None:
        self._bar.update(1)

    def start(self) -> None:
        """Keep the elapsed time moving (or print the periodic line); needs a running loop."""
        self._task = asyncio.ensure_future(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.5 if self.live else self.every_s)
            if self.live:
                self._bar.refresh()
            else:
                say(f"{self.label}... {time.monotonic() - self._t0:.0f} s")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._bar.close()


async def _until_stopped(stopping: asyncio.Event, work: asyncio.Future[Any]) -> bool:
    """Wait for ``work``; False (and ``work`` cancelled) if a stop signal came first."""
    stop = asyncio.ensure_future(stopping.wait())
    done, _ = await asyncio.wait({stop, work}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if work in done:
        work.result()
        return True
    work.cancel()
    return False


async def serve_async(
    plan: ServePlan,
    actor_classes: dict[str, type] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Run until Ctrl-C/SIGTERM. Returns the process exit code."""
    from pdserve.tokenizer import load_tokenizer
    from router.cluster import ClusterSpec, RayCluster
    from router.lifecycle import LifecycleConfig, drain_background
    from router.pool import WorkerPool
    from router.server import Frontend, FrontendConfig
    from router.serving import Router, RouterConfig

    s = plan.serve
    say(
        f"model {plan.model_name}: {plan.model.architecture}, {plan.model.num_hidden_layers} "
        f"layers, {s.engine.load.resolved_dtype} on {s.engine.load.device}; max_model_len "
        f"{plan.max_model_len}"
    )
    tokenizer_task = asyncio.ensure_future(asyncio.to_thread(load_tokenizer, s.engine.load.model))
    pool = WorkerPool()
    num_workers = s.num_decode_workers + s.num_prefill_workers  # prefill is 0 when unified
    progress = StartupProgress(num_workers, "starting Ray and the workers (model load)")
    cluster = RayCluster(
        ClusterSpec(
            engine=s.engine,
            num_prefill_workers=s.num_prefill_workers,
            num_decode_workers=s.num_decode_workers,
            cpus_per_worker=plan.cpus_per_worker,
        ),
        pool,
        ray_address=s.ray_address,
        actor_classes=actor_classes,
        progress=progress.line,
        on_worker_ready=progress.worker_ready,
    )
    tokenizer = await tokenizer_task
    router = Router(
        RouterConfig(
            model_name=plan.model_name,
            max_model_len=plan.max_model_len,
            max_queued_requests=s.max_queued_requests,
            max_queued_tokens=s.max_queued_tokens,
            request_timeout_s=s.request_timeout_s,
            lifecycle=LifecycleConfig(
                block_size=s.engine.cache.block_size, unified=s.mode == "unified"
            ),
            chat_template=s.chat_template,
            tool_call_parser=s.tool_call_parser,
        ),
        tokenizer,
        pool,
    )
    frontend = Frontend(
        router,
        FrontendConfig(s.host, s.port, s.grpc_port, s.api_key, log_level="warning"),
        control=cluster,
    )
    await frontend.start()  # ports first: a conflict fails before any worker starts
    code = 0
    progress.start()
    try:
        cluster.init_ray()
        frontend.capture_signals()  # SIGTERM stops cleanly (Ray installed its own handler)
        started = await _until_stopped(frontend.stopping, asyncio.ensure_future(cluster.start()))
        progress.close()
        if started:
            pool.start()
            print_ready(frontend.urls(), plan, bool(s.api_key))
            if on_ready is not None:
                on_ready()
            await frontend.stopping.wait()
        say("stopping")
    except RuntimeError as e:
        say(f"error: {e}")
        code = 1
    finally:
        progress.close()
        await frontend.stop()
        await drain_background(2.0)
        await cluster.stop()
        await pool.close()
        _shutdown_ray()
        frontend.release_signals()
        say("stopped")
    return code


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def run(args: argparse.Namespace) -> int:
    env.configure_grpc_fork_support()  # before gRPC or Ray load
    setup_logging(args.log_level)
    try:
        plan = build_plan(args)
    except (ConfigError, ValueError) as e:
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve_async(plan))
    except RuntimeError as e:  # a port is taken, a worker failed to start, ...
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
