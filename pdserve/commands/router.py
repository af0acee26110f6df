"""`pdserve router`: one more router (HTTP + gRPC gateways) in front of a running cluster.

Joins the Ray cluster at ``--ray-address`` (or ``$PDSERVE_RAY_ADDRESS``) that a ``pdserve serve``
started, follows its worker registry (workers added, restarted, retired) and serves the same APIs
on its own ports, so routers scale horizontally. ``--model`` must name the cluster's model (the
router tokenizes); the KV block size is taken from the workers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from pdserve import env
from pdserve.commands.multinode_args import add_multinode_args, internal_token
from pdserve.commands.progress import say
from pdserve.commands.serve import resolve_max_model_len, setup_logging
from pdserve.commands.serve_flags import HelpFormatter, add_frontend_args, add_model_args
from pdserve.config import ConfigError, LoadConfig, ServeConfig, default_local_prefill_length
from pdserve.gc_heap import freeze_heap


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "router",
        help="run a router against an existing Ray cluster",
        description="Serve the OpenAI HTTP API and the gRPC API in front of the workers of a "
        "running `pdserve serve` cluster.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--ray-address",
        default=None,
        help=f"the cluster's Ray address, e.g. 10.0.0.5:6379 (default: ${env.RAY_ADDRESS})",
    )
    p.add_argument(
        "--mode",
        default=ServeConfig.mode,
        choices=["disaggregated", "unified"],
        help="unified = always prefill on decode workers",
    )
    add_model_args(p)
    add_frontend_args(p)
    add_multinode_args(p, launches_workers=False)
    p.set_defaults(func=run)


async def route_async(args: argparse.Namespace, ray_address: str) -> int:
    """Follow the cluster and serve until Ctrl-C/SIGTERM; returns the exit code."""
    from pdserve.model.loader import load_model_config
    from pdserve.model.resolve import resolve_model
    from pdserve.tokenizer import load_chat_template, load_tokenizer
    from router.background import drain_background
    from router.cluster import RegistryFollower, shutdown_ray
    from router.lifecycle import LifecycleConfig
    from router.pool import WorkerPool
    from router.server import Frontend, FrontendConfig
    from router.serving import Router, RouterConfig

    model = load_model_config(LoadConfig(model=args.model))
    max_model_len = resolve_max_model_len(args.max_model_len, model)
    tokenizer = await asyncio.to_thread(load_tokenizer, args.model)
    pool = WorkerPool(internal_token=internal_token(args))
    follower = RegistryFollower(pool, ray_address)
    say(f"joining the cluster at {ray_address}")
    await follower.start()
    block_size = pool.workers("decode")[0].info.block_size
    router = Router(
        RouterConfig(
            model_name=args.served_model_name or resolve_model(args.model).name,
            max_model_len=max_model_len,
            max_queued_requests=args.max_queued_requests,
            max_queued_tokens=args.max_queued_tokens,
            request_timeout_s=args.request_timeout,
            log_prompts=args.log_prompts,
            lifecycle=LifecycleConfig(
                block_size=block_size,
                unified=args.mode == "unified",
                max_local_prefill_length=(
                    default_local_prefill_length(w.info.device for w in pool.workers("decode"))
                    if args.max_local_prefill_length is None
                    else args.max_local_prefill_length
                ),
                min_prefill_queue_tokens=args.min_prefill_queue_tokens,
            ),
            chat_template=load_chat_template(args.chat_template) if args.chat_template else None,
            tool_call_parser=args.tool_call_parser,
        ),
        tokenizer,
        pool,
    )
    api_key = args.api_key or env.api_key()
    frontend = Frontend(
        router,
        FrontendConfig(
            args.host,
            args.port,
            args.grpc_port,
            api_key,
            max_concurrent_streams=args.max_concurrent_streams,
            drain_timeout_s=args.drain_timeout,
        ),
    )
    await frontend.start()
    pool.start()
    freeze_heap()  # the router's startup heap: no GC pauses over it while serving
    urls = frontend.urls()
    workers = ", ".join(w.worker_id for w in pool)
    say(f"ready: routing to {workers}")
    say(f"  OpenAI API  {urls['openai']}   gRPC API  {urls['grpc']}   metrics {urls['metrics']}")
    try:
        await frontend.stopping.wait()
        say("stopping")
    finally:
        await frontend.stop()
        await drain_background(2.0)
        await follower.stop()
        await pool.close()
        shutdown_ray()  # now, not at exit: Ray's exit hook takes ~1 s longer to disconnect
        frontend.release_signals()
    return 0


def run(args: argparse.Namespace) -> int:
    env.configure_grpc_fork_support()  # before gRPC or Ray load
    setup_logging(args.log_level)
    address = args.ray_address or env.ray_address()
    if not address:
        print(
            "pdserve router: --ray-address (or $PDSERVE_RAY_ADDRESS) is required", file=sys.stderr
        )
        return 2
    try:
        ServeConfig(  # the flags this command shares with `pdserve serve`, checked the same way
            max_local_prefill_length=args.max_local_prefill_length or 0,
            min_prefill_queue_tokens=args.min_prefill_queue_tokens,
            max_concurrent_streams=args.max_concurrent_streams,
            drain_timeout_s=args.drain_timeout,
        )
        return asyncio.run(route_async(args, address))
    except (ConfigError, ValueError) as e:  # a bad flag: exit 2, as `pdserve serve` (argparse)
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the cluster, a port, ...
        print(f"pdserve router: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
