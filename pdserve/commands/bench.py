"""`pdserve bench serve | sweep | plot`: benchmark any OpenAI-compatible server.

Flag names follow ``vllm bench serve`` where the two overlap, so a command line moves between the
tools with few edits. See docs/bench.md for examples.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.datasets import (
    DATASETS,
    DatasetError,
    SampleRequest,
    jsonl_requests,
    mixed_requests,
    random_requests,
    shared_prefix_requests,
)
from pdserve.bench.metrics import METRIC_NAMES, parse_goodput, parse_percentiles
from pdserve.bench.word_tokenizer import BUILTIN, BenchTokenizer, load_bench_tokenizer


def register(subparsers: Any) -> None:
    """Add ``bench`` with its ``serve``, ``sweep`` and ``plot`` subcommands."""
    bench = subparsers.add_parser(
        "bench", help="benchmark an OpenAI-compatible server", description=__doc__
    )
    sub = bench.add_subparsers(dest="bench_command", metavar="{serve,sweep,plot}")
    serve = sub.add_parser(
        "serve",
        help="run one workload against a server and report TTFT/TPOT/ITL/E2EL and throughput",
    )
    add_workload_args(serve)
    serve.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (default inf: all at once, paced by --max-concurrency)",
    )
    serve.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most this many requests in flight (default unlimited)",
    )
    add_output_args(serve)
    serve.set_defaults(func=run_serve)

    sweep = sub.add_parser(
        "sweep", help="run one workload at several concurrencies or rates and plot the curve"
    )
    add_workload_args(sweep)
    group = sweep.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--max-concurrency-list",
        type=_int_list,
        default=None,
        help="comma-separated concurrencies, e.g. 1,2,4,8 (request rate inf)",
    )
    group.add_argument(
        "--request-rate-list",
        type=_float_list,
        default=None,
        help="comma-separated request rates, e.g. 0.5,1,2 (req/s)",
    )
    sweep.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="concurrency cap for every run of a --request-rate-list sweep",
    )
    sweep.add_argument(
        "--result-dir",
        default="bench-sweep",
        help="where per-run JSON, summary.json and PNGs go (default bench-sweep)",
    )
    sweep.set_defaults(func=run_sweep_cmd)

    plot = sub.add_parser("plot", help="turn result JSON files into PNG charts")
    plot.add_argument("results", nargs="+", help="result files from bench serve/sweep (or vLLM)")
    plot.add_argument("--output-dir", default=".", help="where the PNGs go (default .)")
    plot.set_defaults(func=run_plot)
    bench.set_defaults(func=lambda _a: _usage(bench))


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give integers > 0")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers > 0")
    return values


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Server, dataset, arrival and sampling flags shared by ``serve`` and ``sweep``."""
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server base URL")
    s.add_argument(
        "--endpoint",
        default="/v1/completions",
        help="/v1/completions (default) or /v1/chat/completions",
    )
    s.add_argument(
        "--model",
        default=None,
        help="model name sent in requests (default: first id from GET /v1/models)",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        help="name to send if it differs from --model (--model still names the tokenizer)",
    )
    s.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for building prompts: 'smollm2', a HF dir, a .gguf, or "
        f"'{BUILTIN}' (no model files; one token per word). Default: --model if "
        "it names a local model, else smollm2",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, as vLLM's client)",
    )
    s.add_argument(
        "--request-timeout",
        type=float,
        default=6 * 3600.0,
        help="seconds one request may take (default 6 h)",
    )
    s.add_argument(
        "--ready-timeout",
        type=float,
        default=0.0,
        help="retry the first request for up to this many seconds while the server "
        "starts (default 0: no wait)",
    )
    s.add_argument("--label", default="pdserve", help="name of this run in results and plots")

    d = p.add_argument_group("dataset")
    d.add_argument(
        "--dataset-name", choices=DATASETS, default="random", help="workload (default random)"
    )
    d.add_argument("--dataset-path", default=None, help="JSONL trace (--dataset-name jsonl)")
    d.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests to send (default 1000; shared-prefix: groups x prompts; "
        "jsonl: the whole trace)",
    )
    d.add_argument("--seed", type=int, default=0, help="seeds prompts and arrival times")
    d.add_argument(
        "--random-input-len",
        type=int,
        default=1024,
        help="prompt tokens per request (default 1024, as vLLM's client)",
    )
    d.add_argument(
        "--random-output-len",
        type=int,
        default=128,
        help="output tokens asked per request (default 128)",
    )
    d.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)], r in [0, 1)",
    )
    d.add_argument(
        "--random-prefix-len",
        type=int,
        default=0,
        help="tokens of one random prefix shared by every prompt",
    )
    for name, default, what in (
        ("num-groups", 4, "groups sharing one system prompt"),
        ("prompts-per-group", 8, "prompts per group"),
        ("system-len", 512, "tokens of each group's shared system prompt"),
        ("question-len", 64, "tokens of each prompt's own question"),
        ("output-len", 64, "output tokens asked per request"),
    ):
        d.add_argument(
            f"--shared-prefix-{name}", type=int, default=default, help=f"{what} (default {default})"
        )
    d.add_argument(
        "--mixed-long-fraction",
        type=float,
        default=0.1,
        help="fraction of long RAG-style prompts (default 0.1)",
    )
    for name, default in (
        ("short-input-len", 64),
        ("short-output-len", 128),
        ("long-input-len", 2048),
        ("long-output-len", 64),
    ):
        kind, io = name.split("-")[:2]
        d.add_argument(
            f"--mixed-{name}",
            type=int,
            default=default,
            help=f"{'prompt' if io == 'input' else 'output'} tokens of a {kind} request "
            f"(default {default})",
        )
    d.add_argument(
        "--trace-time-scale",
        type=float,
        default=1.0,
        help="multiply trace timestamps (0.5 = replay twice as fast)",
    )

    a = p.add_argument_group("traffic and sampling")
    a.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival gaps (1 = Poisson)",
    )
    a.add_argument(
        "--num-warmups",
        type=int,
        default=1,
        help="unmeasured warm-up requests before the run (default 1)",
    )
    a.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to ignore EOS so outputs have the requested length",
    )
    for flag, parse in (("--temperature", float), ("--top-p", float), ("--top-k", int)):
        a.add_argument(flag, type=parse, default=None, help="sent when given (default: not sent)")
    a.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    a.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (ms)",
    )
    a.add_argument(
        "--percentiles",
        "--metric-percentiles",
        dest="percentiles",
        default="99",
        help="comma-separated percentiles to report (default 99)",
    )
    a.add_argument(
        "--percentile-metrics",
        default=",".join(METRIC_NAMES),
        help="metrics to report: any of ttft,tpot,itl,e2el (default all)",
    )
    a.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """Result-file flags of ``serve``."""
    o = p.add_argument_group("output")
    o.add_argument("--save-result", action="store_true", help="write the result JSON")
    o.add_argument("--result-dir", default=".", help="directory of the result JSON")
    o.add_argument(
        "--result-filename",
        default=None,
        help="file name (default {label}-{rate}qps[-concurrencyC]-{model}-{time}.json)",
    )
    o.add_argument(
        "--no-save-texts", action="store_true", help="leave generated texts out of the result JSON"
    )


def pick_tokenizer_name(args: argparse.Namespace) -> str:
    """--tokenizer, else --model when it names a local model, else 'smollm2'."""
    if args.tokenizer:
        return str(args.tokenizer)
    if args.model:
        from pdserve.model.resolve import resolve_model

        try:
            resolve_model(args.model)
            return str(args.model)
        except ValueError:
            pass
    return "smollm2"


def build_requests(args: argparse.Namespace, tokenizer: BenchTokenizer) -> list[SampleRequest]:
    """The workload named by ``--dataset-name``. Raises DatasetError on bad arguments."""
    name = args.dataset_name
    n = args.num_prompts
    if n is not None and n <= 0:
        raise DatasetError(f"--num-prompts must be > 0, got {n}")
    if name == "random":
        return random_requests(
            tokenizer, n or 1000, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.random_prefix_len, args.seed,
        )  # fmt: skip
    if name == "shared-prefix":
        total = args.shared_prefix_num_groups * args.shared_prefix_prompts_per_group
        if n is not None and n != total:
            raise DatasetError(
                f"--num-prompts {n} conflicts with shared-prefix groups x prompts = {total}; "
                "set --shared-prefix-num-groups / --shared-prefix-prompts-per-group instead"
            )
        return shared_prefix_requests(
            tokenizer, args.shared_prefix_num_groups, args.shared_prefix_prompts_per_group,
            args.shared_prefix_system_len, args.shared_prefix_question_len,
            args.shared_prefix_output_len, args.seed,
        )  # fmt: skip
    if name == "mixed":
        return mixed_requests(
            tokenizer, n or 1000, args.mixed_long_fraction, args.mixed_short_input_len,
            args.mixed_short_output_len, args.mixed_long_input_len, args.mixed_long_output_len,
            args.random_range_ratio, args.seed,
        )  # fmt: skip
    if not args.dataset_path:
        raise DatasetError("--dataset-name jsonl needs --dataset-path FILE")
    return jsonl_requests(tokenizer, args.dataset_path, n, args.trace_time_scale, args.seed)


def build_config(args: argparse.Namespace, **overrides: Any) -> Any:
    """BenchConfig from parsed flags (``overrides`` replace fields). Raises ValueError."""
    from pdserve.bench.serve import BenchConfig

    extra: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body is not valid JSON: {e.msg}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
    for key in ("temperature", "top_p", "top_k"):
        if getattr(args, key) is not None:
            extra[key] = getattr(args, key)
    metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    for m in metrics:
        if m not in METRIC_NAMES:
            raise ValueError(f"--percentile-metrics: {m!r} is not one of {','.join(METRIC_NAMES)}")
    fields: dict[str, Any] = dict(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        served_model_name=args.served_model_name,
        request_rate=args.request_rate if "request_rate" in args else math.inf,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        num_warmups=args.num_warmups,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
        percentiles=tuple(parse_percentiles(args.percentiles)),
        percentile_metrics=metrics,
        slos_ms=parse_goodput(args.goodput or []),
        extra_body=extra,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
        ready_timeout_s=args.ready_timeout,
        disable_tqdm=args.disable_tqdm,
        label=args.label,
    )
    fields.update(overrides)
    return BenchConfig(**fields)


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    """Command-line settings worth recording (no callables, no secrets)."""
    skip = {"func", "api_key", "command", "bench_command"}
    out: dict[str, Any] = {}
    for k, v in vars(args).items():
        if k in skip:
            continue
        out[k] = "inf" if isinstance(v, float) and math.isinf(v) else v
    return out


def _prepare(args: argparse.Namespace) -> tuple[BenchTokenizer, list[SampleRequest]]:
    tokenizer = load_bench_tokenizer(pick_tokenizer_name(args))
    return tokenizer, build_requests(args, tokenizer)


def _fail(msg: str) -> int:
    print(f"pdserve bench: error: {msg}", file=sys.stderr)
    return 2


def run_serve(args: argparse.Namespace) -> int:
    """`pdserve bench serve`: run, print the table, optionally save JSON."""
    from pdserve.bench.report import default_filename, format_table, result_to_dict, save_result
    from pdserve.bench.serve import BenchmarkError, run_benchmark

    try:
        config = build_config(args)
        tokenizer, requests = _prepare(args)
        result = asyncio.run(run_benchmark(config, requests, tokenizer))
    except (ValueError, BenchmarkError) as e:  # DatasetError and ConfigError are ValueErrors
        return _fail(str(e))
    print(format_table(result))
    if args.save_result:
        doc = result_to_dict(result, _settings(args), save_texts=not args.no_save_texts)
        name = args.result_filename or default_filename(doc)
        path = save_result(doc, Path(args.result_dir) / name)
        print(f"result saved to {path}")
    return 0


def run_sweep_cmd(args: argparse.Namespace) -> int:
    """`pdserve bench sweep`: one run per concurrency or rate, then summary and plots."""
    from pdserve.bench.serve import BenchmarkError
    from pdserve.bench.sweep import run_sweep

    try:
        config = build_config(args)
        tokenizer, requests = _prepare(args)
        if args.max_concurrency_list:
            points = [{"max_concurrency": c, "request_rate": math.inf}
                      for c in args.max_concurrency_list]  # fmt: skip
        else:
            points = [{"request_rate": r} for r in args.request_rate_list]
        summary = run_sweep(config, requests, tokenizer, points, Path(args.result_dir),
                            _settings(args))  # fmt: skip
    except (ValueError, BenchmarkError) as e:
        return _fail(str(e))
    print(f"sweep summary and plots written to {summary.parent}")
    return 0


def run_plot(args: argparse.Namespace) -> int:
    """`pdserve bench plot`: PNG charts from result files."""
    from pdserve.bench.plot import plot_results
    from pdserve.bench.report import ResultValidationError

    try:
        paths = plot_results([Path(p) for p in args.results], Path(args.output_dir))
    except (ResultValidationError, ValueError) as e:
        return _fail(str(e))
    for p in paths:
        print(p)
    return 0
