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
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import env
from pdserve.commands.multinode_args import add_multinode_args, internal_token
from pdserve.commands.progress import StartupProgress, say
from pdserve.commands.serve_flags import (
    HelpFormatter,
    add_cluster_args,
    add_engine_args,
    add_fault_args,
    add_frontend_args,
    add_model_args,
)
from pdserve.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoadConfig,
    ModelConfig,
    SchedulerConfig,
    ServeConfig,
    TransferConfig,
    check_cpus_per_worker,
    default_local_prefill_length,
    default_prefill_niceness,
)
from pdserve.gc_heap import freeze_heap

log = logging.getLogger("pdserve.serve")


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
    add_fault_args(p)
    add_multinode_args(p, launches_workers=True)
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
    prefill_resources: dict[str, float] = field(default_factory=dict)  # Ray custom resources
    decode_resources: dict[str, float] = field(default_factory=dict)
    router_flags: tuple[str, ...] = ()  # flags a joining `pdserve router` must repeat


def local_prefill_thread(args: argparse.Namespace, device: str) -> bool | None:
    """``--local-prefill-thread`` when given; else automatic (None) where decode workers prefill
    every prompt (unified mode, or disaggregated with no prefill workers). In disaggregated mode
    it is on for CPU decode workers with conditional disaggregation (``--max-local-prefill-length``
    > 0), whose local prompts otherwise ride inside decode steps and stall every running
    sequence for the whole prompt (SmolLM2 fp32, a 2-core Zen 1 EPYC, main workload: p99 ITL 2.2 s
    inline against 0.38-0.47 s on the thread, throughput as high; docs/benchmarks.md, session 27), and
    off otherwise (decode workers keep all their threads for decoding)."""
    if args.local_prefill_thread is not None:
        return bool(args.local_prefill_thread)
    if args.mode == "unified" or args.num_prefill_workers == 0:
        return None
    return device == "cpu" and max_local_prefill_length(args, device) > 0


def max_local_prefill_length(args: argparse.Namespace, device: str) -> int:
    """``--max-local-prefill-length``, or its default for decode workers on ``device``
    (:func:`pdserve.config.default_local_prefill_length`)."""
    if args.max_local_prefill_length is not None:
        return int(args.max_local_prefill_length)
    return default_local_prefill_length([device])


def build_plan(args: argparse.Namespace) -> ServePlan:
    """Validate flags and read the model config (no weights). Raises ConfigError naming the flag."""
    from pdserve.attention.selector import select_attention_backend
    from pdserve.model.loader import load_model_config
    from pdserve.model.resolve import resolve_model
    from pdserve.tokenizer import load_chat_template

    load = LoadConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=resolve_device(args.device),
        seed=args.seed,
        attention_backend=args.attention_backend,
        torch_compile=not args.enforce_eager,
    )
    model = load_model_config(load)
    select_attention_backend(load.attention_backend, load.device, model.head_dim)
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
            f"each worker's KV cache holds {capacity} tokens of {load.resolved_dtype} KV, less "
            f"than --max-model-len {max_model_len}; raise --kv-cache-memory-bytes or lower "
            "--max-model-len"
        )
    engine = EngineConfig(
        load=load,
        cache=cache,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            prefill_max_num_batched_tokens=args.prefill_max_num_batched_tokens,
            local_prefill_thread=local_prefill_thread(args, load.device),
        ),
        transfer=TransferConfig(timeout_s=args.kv_transfer_timeout),
        worker_host=args.worker_host,
        internal_token=internal_token(args),
        enable_fault_injection=args.enable_fault_injection,
        prefill_niceness=(
            default_prefill_niceness(load.device)
            if args.prefill_niceness is None
            else args.prefill_niceness
        ),
    )
    unified = args.mode == "unified"
    num_prefill = args.num_prefill_workers
    if unified and num_prefill:
        raise ConfigError(
            f"--num-prefill-workers {num_prefill} has no effect with --mode unified (the decode "
            "workers prefill locally): drop it, or use --mode disaggregated"
        )
    if num_prefill is None:
        num_prefill = ServeConfig.num_prefill_workers
    serve = ServeConfig(
        engine=engine,
        mode=args.mode,
        num_prefill_workers=0 if unified else num_prefill,
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
        max_concurrent_streams=args.max_concurrent_streams,
        log_prompts=args.log_prompts,
        chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
        tool_call_parser=args.tool_call_parser,
        max_local_prefill_length=max_local_prefill_length(args, load.device),
        min_prefill_queue_tokens=args.min_prefill_queue_tokens,
        drain_timeout_s=args.drain_timeout,
    )
    if args.cpus_per_worker is not None:
        check_cpus_per_worker(args.cpus_per_worker)
    name = args.served_model_name or resolve_model(args.model).name
    return ServePlan(
        serve,
        model,
        name,
        max_model_len,
        args.cpus_per_worker,
        args.log_level or "info",
        prefill_resources=args.prefill_resources,
        decode_resources=args.decode_resources,
        router_flags=router_flags(args),
    )


def router_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """The `pdserve serve` flags a `pdserve router` joining this cluster must repeat (beyond
    ``--ray-address`` and ``--model``, which the cluster's line names), for the startup hint.
    Secrets are never printed: ``KEY`` / ``TOKEN`` stand for this server's."""
    flags: list[str] = []
    template = args.chat_template
    if template is not None and Path(template).expanduser().is_file():
        template = str(Path(template).expanduser().resolve())  # the line works from any folder
    for flag, value in (
        ("--served-model-name", args.served_model_name),
        ("--max-model-len", args.max_model_len),
        ("--chat-template", template),
        ("--tool-call-parser", args.tool_call_parser),
    ):
        if value is not None:
            flags += [flag, shlex.quote(str(value))]
    if args.mode == "unified":
        flags += ["--mode", "unified"]
    if args.max_local_prefill_length is not None:  # else the router picks the same default
        flags += ["--max-local-prefill-length", str(args.max_local_prefill_length)]
    if args.min_prefill_queue_tokens != ServeConfig.min_prefill_queue_tokens:
        flags += ["--min-prefill-queue-tokens", str(args.min_prefill_queue_tokens)]
    if args.api_key or env.api_key():
        flags += ["--api-key", "KEY"]  # a placeholder that fails closed if pasted as is
    if internal_token(args):
        flags += ["--internal-token", "TOKEN"]
    return tuple(flags)


# -- running ----------------------------------------------------------------------------------------


def print_ready(urls: dict[str, str], plan: ServePlan, api_key: bool) -> None:
    s = plan.serve
    workers = (
        f"{s.num_decode_workers} decode worker(s), local prefill"
        if s.mode == "unified"
        else f"{s.num_prefill_workers} prefill + {s.num_decode_workers} decode workers"
    )
    auth = ' -H "Authorization: Bearer <your --api-key>"' if api_key else ""
    lines = [
        f"ready: model '{plan.model_name}' ({s.mode}: {workers}, max_model_len "
        f"{plan.max_model_len})",
        f"  OpenAI API  {urls['openai']}   (try: curl{auth} {urls['openai']}/models)",
        f"  gRPC API    {urls['grpc']}   (pdserve.v1.Generation, grpc.health.v1, reflection)",
        f"  metrics     {urls['metrics']}   health {urls['health']}",
        f"  dashboard   {urls['dashboard']}",
        "  Ctrl-C to stop",
    ]
    if s.mode != "unified" and s.num_prefill_workers and s.max_local_prefill_length:
        lines.insert(
            1,
            f"  conditional disaggregation: prompts of <= {s.max_local_prefill_length} tokens are "
            f"prefilled on their decode worker while they would wait behind >= "
            f"{s.min_prefill_queue_tokens} tokens on every prefill worker "
            "(--max-local-prefill-length 0: off)",
        )
    if s.mode != "unified" and s.num_prefill_workers and s.engine.prefill_niceness:
        lines.insert(
            1,
            f"  prefill workers run at niceness {s.engine.prefill_niceness}: decode steps win "
            "the CPU time the roles share (--prefill-niceness 0: equal)",
        )
    for line in lines:
        say(line)


def worker_actor_classes() -> dict[str, type]:
    """The real worker actor classes (imported here, lazily: they load torch)."""
    from decode_worker.actor import DecodeActor
    from prefill_worker.actor import PrefillActor

    return {"prefill": PrefillActor, "decode": DecodeActor}


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
    """Run until Ctrl-C/SIGTERM. Returns the process exit code.

    ``actor_classes``: role -> worker actor class (default: the real prefill and decode actors).
    """
    from pdserve.tokenizer import load_tokenizer
    from router.background import drain_background
    from router.cluster import ClusterSpec, RayCluster, shutdown_ray
    from router.lifecycle import LifecycleConfig
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
    pool = WorkerPool(internal_token=s.engine.internal_token)
    num_workers = s.num_decode_workers + s.num_prefill_workers  # prefill is 0 when unified
    progress = StartupProgress(num_workers, "starting Ray and the workers (model load)")
    cluster = RayCluster(
        ClusterSpec(
            engine=s.engine,
            num_prefill_workers=s.num_prefill_workers,
            num_decode_workers=s.num_decode_workers,
            cpus_per_worker=plan.cpus_per_worker,
            prefill_resources=plan.prefill_resources,
            decode_resources=plan.decode_resources,
            router_flags=plan.router_flags,
            router_ports=None if 0 in (s.port, s.grpc_port) else (s.port, s.grpc_port),
        ),
        pool,
        ray_address=s.ray_address,
        actor_classes=actor_classes or worker_actor_classes(),
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
            log_prompts=s.log_prompts,
            lifecycle=LifecycleConfig(
                block_size=s.engine.cache.block_size,
                unified=s.mode == "unified",
                max_local_prefill_length=s.max_local_prefill_length,
                min_prefill_queue_tokens=s.min_prefill_queue_tokens,
            ),
            chat_template=s.chat_template,
            tool_call_parser=s.tool_call_parser,
        ),
        tokenizer,
        pool,
    )
    frontend = Frontend(
        router,
        FrontendConfig(
            s.host,
            s.port,
            s.grpc_port,
            s.api_key,
            log_level="warning",
            enable_fault_injection=s.engine.enable_fault_injection,
            max_concurrent_streams=s.max_concurrent_streams,
            drain_timeout_s=s.drain_timeout_s,
        ),
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
            freeze_heap()  # the router's startup heap: no GC pauses over it while serving
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
        shutdown_ray()
        frontend.release_signals()
        say("stopped")
    return code


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
