"""`pdserve serve` / `pdserve router` flag handling, environment variables and port binding."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import io
import logging
import os
import shlex
import sys
from pathlib import Path

import pytest

from pdserve import env
from pdserve.commands import progress, serve
from pdserve.commands import router as router_cmd
from pdserve.config import CPU_MAX_LOCAL_PREFILL_LENGTH, ConfigError, default_local_prefill_length
from router.cluster.ray_join import join_hint
from router.server import bind_socket


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    serve.register(sub)
    router_cmd.register(sub)
    return parser.parse_args(list(argv))


def test_defaults_build_a_disaggregated_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.API_KEY, raising=False)
    monkeypatch.delenv(env.RAY_ADDRESS, raising=False)
    plan = serve.build_plan(parse("serve", "--device", "cpu"))
    s = plan.serve
    assert (s.mode, s.num_prefill_workers, s.num_decode_workers) == ("disaggregated", 1, 1)
    assert (s.host, s.port, s.grpc_port) == ("0.0.0.0", 8000, 50051)
    assert plan.model_name == "smollm2" and plan.max_model_len == 8192
    assert s.engine.scheduler.max_model_len == 8192 and s.engine.cache.enable_prefix_caching
    assert s.api_key is None and s.ray_address is None
    assert s.engine.load.torch_compile  # workers compile the model unless --enforce-eager


def test_enforce_eager_turns_compilation_off() -> None:
    plan = serve.build_plan(parse("serve", "--device", "cpu", "--enforce-eager"))
    assert not plan.serve.engine.load.torch_compile


def test_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.API_KEY, " from-env ")
    monkeypatch.setenv(env.RAY_ADDRESS, "10.0.0.1:6379")
    args = parse(
        "serve", "--device", "cpu", "--mode", "unified", "--max-model-len", "1024",
        "--served-model-name", "tiny", "--dtype", "bfloat16", "--block-size", "32",
        "--no-enable-prefix-caching", "--max-num-seqs", "8", "--long-prefill-token-threshold", "96",
    )  # fmt: skip
    plan = serve.build_plan(args)
    s = plan.serve
    assert s.mode == "unified" and s.num_prefill_workers == 0
    assert s.api_key == "from-env" and s.ray_address == "10.0.0.1:6379"
    assert plan.model_name == "tiny" and plan.max_model_len == 1024
    assert s.engine.load.dtype == "bfloat16" and s.engine.cache.block_size == 32
    assert not s.engine.cache.enable_prefix_caching and s.engine.scheduler.max_num_seqs == 8
    assert s.engine.scheduler.long_prefill_token_threshold == 96
    args = parse("serve", "--device", "cpu", "--api-key", "flag")
    assert serve.build_plan(args).serve.api_key == "flag"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-model-len", "100000"], "exceeds the model's context length"),
        (["--kv-cache-memory-bytes", "1000000"], "raise --kv-cache-memory-bytes"),
        (["--block-size", "12"], "--block-size"),
        (["--num-decode-workers", "0"], "--num-decode-workers"),
        (["--model", "/nonexistent/model"], "not found"),
        (["--device", "tpu"], "--device"),
        (["--cpus-per-worker", "0"], "--cpus-per-worker must be a number >= 0.0001"),
        (["--cpus-per-worker", "nan"], "--cpus-per-worker must be a number >= 0.0001"),
        (["--cpus-per-worker", "inf"], "--cpus-per-worker must be a number >= 0.0001"),
        (["--max-local-prefill-length", "-1"], "--max-local-prefill-length must be >= 0"),
        (["--min-prefill-queue-tokens", "-1"], "--min-prefill-queue-tokens must be >= 0"),
        (["--prefill-niceness", "20"], r"--prefill-niceness must be in \[0, 19\], got 20"),
        (["--prefill-niceness", "-1"], "--prefill-niceness must be in"),
        (["--drain-timeout", "-1"], "--drain-timeout must be a finite number of seconds >= 0"),
        (["--drain-timeout", "nan"], "--drain-timeout must be a finite number of seconds >= 0"),
        (["--drain-timeout", "inf"], "--drain-timeout must be a finite number of seconds >= 0"),
    ],
)
def test_bad_flags_name_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        serve.build_plan(parse("serve", "--device", "cpu", *argv))


def test_log_level_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.LOG_LEVEL, "warning")
    assert env.log_level() == logging.WARNING
    monkeypatch.setenv(env.LOG_LEVEL, "loud")
    with pytest.raises(ValueError, match="PDSERVE_LOG_LEVEL"):
        env.log_level()


def test_router_command_needs_a_ray_address(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(env.RAY_ADDRESS, raising=False)
    assert router_cmd.run(parse("router")) == 2
    assert "--ray-address" in capsys.readouterr().err
    bad = parse("router", "--ray-address", "127.0.0.1:1", "--max-local-prefill-length", "-3")
    assert router_cmd.run(bad) == 2  # a bad flag, as serve: checked before joining the cluster
    assert "--max-local-prefill-length must be >= 0" in capsys.readouterr().err


def test_taken_port_names_the_flag() -> None:
    first = bind_socket("127.0.0.1", 0, "--port")
    try:
        port = first.getsockname()[1]
        with pytest.raises(RuntimeError, match="choose another --port"):
            bind_socket("127.0.0.1", port, "--port")
    finally:
        first.close()


def test_grpc_fork_support_is_off_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC fork handlers off for our processes (log spam), a user's choice kept."""

    monkeypatch.delenv(env.GRPC_FORK_SUPPORT, raising=False)
    env.configure_grpc_fork_support()
    assert os.environ[env.GRPC_FORK_SUPPORT] == "0"
    monkeypatch.setenv(env.GRPC_FORK_SUPPORT, "1")
    env.configure_grpc_fork_support()
    assert os.environ[env.GRPC_FORK_SUPPORT] == "1"


async def test_startup_progress_bar_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """README: model loading shows a progress bar (stderr, terminal); lines go to stdout."""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err, out = Tty(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", out)
    p = progress.StartupProgress(2, "loading")
    assert p.live
    p.start()
    p.line("prefill-0 ready")
    p.worker_ready()
    await asyncio.sleep(0.6)  # one refresh of the elapsed time
    p.worker_ready()
    p.close()
    assert "2/2 workers loaded" in err.getvalue() and "1/2 workers loaded" in err.getvalue()
    assert "[pdserve] prefill-0 ready" in out.getvalue()


async def test_startup_progress_in_a_log_prints_lines(capsys: pytest.CaptureFixture[str]) -> None:
    p = progress.StartupProgress(1, "loading", every_s=0.1)
    assert not p.live
    p.start()
    await asyncio.sleep(0.25)
    p.line("decode-0 ready")
    p.worker_ready()
    p.close()
    out, err = capsys.readouterr()
    assert "[pdserve] loading... 0 s" in out and "[pdserve] decode-0 ready" in out
    assert "workers loaded" not in err


def test_unified_mode_refuses_a_prefill_worker_count() -> None:
    """New-user #8: the count was silently dropped."""
    with pytest.raises(ConfigError, match="--num-prefill-workers 2 has no effect with --mode"):
        serve.build_plan(parse("serve", "--device", "cpu", "--mode", "unified",
                               "--num-prefill-workers", "2"))  # fmt: skip
    for extra in ([], ["--num-prefill-workers", "0"]):
        plan = serve.build_plan(parse("serve", "--device", "cpu", "--mode", "unified", *extra))
        assert plan.serve.num_prefill_workers == 0
    plan = serve.build_plan(parse("serve", "--device", "cpu", "--num-prefill-workers", "2"))
    assert plan.serve.num_prefill_workers == 2


def test_router_hint_repeats_the_flags_a_router_must_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """New-user #6: the "more routers" line dropped --served-model-name (and other flags the
    joining router must repeat); secrets appear as placeholders only."""
    monkeypatch.delenv(env.API_KEY, raising=False)
    args = parse(
        "serve", "--device", "cpu", "--mode", "unified", "--served-model-name", "smol hf",
        "--max-model-len", "1024", "--tool-call-parser", "json", "--api-key", "s3cret",
        "--max-local-prefill-length", "300",
    )  # fmt: skip
    plan = serve.build_plan(args)
    monkeypatch.setenv(env.RAY_AUTH_MODE, "token")
    hint = join_hint("1.2.3.4:6379", "smollm2", plan.router_flags)
    assert "s3cret" not in hint and "RAY_AUTH_TOKEN" in hint.partition("   (")[2]
    command = hint.removeprefix("more routers: pdserve ").partition("   (")[0]
    import shlex

    routed = parse(*shlex.split(command))  # the printed line parses as a router command
    assert routed.served_model_name == "smol hf" and routed.max_model_len == 1024
    assert routed.mode == "unified" and routed.tool_call_parser == "json"
    assert routed.api_key == "KEY" and routed.max_local_prefill_length == 300
    assert serve.build_plan(parse("serve", "--device", "cpu")).router_flags == ()


def test_router_hint_names_a_chat_template_file_by_its_absolute_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """New-user (session 40): a relative --chat-template in the printed router line failed
    when pasted from another folder."""
    (tmp_path / "t.jinja").write_text("{{ messages[0]['content'] }}")
    monkeypatch.chdir(tmp_path)
    flags = serve.build_plan(parse("serve", "--device", "cpu", "--chat-template", "t.jinja"))
    assert flags.router_flags == ("--chat-template", str(tmp_path / "t.jinja"))
    inline = "{{ messages[0]['content'] }}"  # an inline template stays as it is
    plan = serve.build_plan(parse("serve", "--device", "cpu", "--chat-template", inline))
    assert plan.router_flags == ("--chat-template", shlex.quote(inline))


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ([], True),  # conditional disaggregation is on by default for CPU decode workers
        (["--max-local-prefill-length", "0"], False),  # off: they keep their threads for decoding
        (["--max-local-prefill-length", "512"], True),
        (["--max-local-prefill-length", "512", "--no-local-prefill-thread"], False),
        (["--local-prefill-thread"], True),
        (["--mode", "unified"], None),  # automatic: decided by the worker's thread count
        (["--num-prefill-workers", "0"], None),
    ],
)
def test_local_prefill_thread_default(extra: list[str], expected: bool | None) -> None:
    """Local prompts of conditional disaggregation run on a thread of their own on CPU, not as
    chunks inside decode steps that stall every running sequence for a whole prompt."""
    plan = serve.build_plan(parse("serve", "--device", "cpu", *extra))
    assert plan.serve.engine.scheduler.local_prefill_thread is expected
    args = parse("serve", "--device", "cpu", "--max-local-prefill-length", "512")
    assert serve.local_prefill_thread(args, "cuda") is False


def test_conditional_disaggregation_default_follows_the_decode_device() -> None:
    """``--max-local-prefill-length`` unset: on (512 tokens) for CPU decode workers, off for GPU
    ones (and for a cluster that mixes them); a given value wins either way."""
    assert default_local_prefill_length(["cpu"]) == CPU_MAX_LOCAL_PREFILL_LENGTH == 512
    assert default_local_prefill_length(["cpu", "cpu"]) == 512
    assert default_local_prefill_length(["cuda"]) == 0
    assert default_local_prefill_length(["cpu", "cuda:1"]) == 0
    assert default_local_prefill_length([]) == 0
    assert default_local_prefill_length([""]) == 0  # a worker that did not report its device
    plan = serve.build_plan(parse("serve", "--device", "cpu"))
    assert plan.serve.max_local_prefill_length == 512
    assert plan.serve.min_prefill_queue_tokens == 256
    args = parse("serve", "--device", "cpu", "--max-local-prefill-length", "0")
    assert serve.build_plan(args).serve.max_local_prefill_length == 0
    assert serve.max_local_prefill_length(parse("serve", "--device", "cpu"), "cuda") == 0
    args = parse("serve", "--device", "cpu", "--max-local-prefill-length", "64")
    assert serve.max_local_prefill_length(args, "cuda") == 64
    assert parse("router", "--ray-address", "127.0.0.1:1").max_local_prefill_length is None


def test_ready_lines_say_when_conditional_disaggregation_is_on(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """New-user report: the startup banner named neither the default nor how to turn it off."""
    urls = {k: f"http://x/{k}" for k in ("openai", "grpc", "metrics", "health", "dashboard")}
    serve.print_ready(urls, serve.build_plan(parse("serve", "--device", "cpu")), False)
    out = capsys.readouterr().out
    assert out.startswith("[pdserve] ready: model")
    assert "dashboard   http://x/dashboard" in out
    assert (
        "prompts of <= 512 tokens" in out and "behind >= 256 tokens on every prefill worker" in out
    )
    assert "--max-local-prefill-length 0: off" in out
    assert "prefill workers run at niceness 5" in out and "--prefill-niceness 0" in out
    for extra in (["--max-local-prefill-length", "0"], ["--mode", "unified"]):
        serve.print_ready(urls, serve.build_plan(parse("serve", "--device", "cpu", *extra)), False)
        assert "conditional disaggregation" not in capsys.readouterr().out
    for extra in (["--prefill-niceness", "0"], ["--mode", "unified"]):
        serve.print_ready(urls, serve.build_plan(parse("serve", "--device", "cpu", *extra)), False)
        assert "niceness" not in capsys.readouterr().out


def test_kv_transfer_series_exist_before_the_first_transfer() -> None:
    """Both paths' ok series are exported at 0 from the start (rate() and alerts need them)."""
    from pdserve import metrics

    text = metrics.render().decode()
    for path in ("transferred", "local"):
        assert f'pdserve_kv_transfers_total{{outcome="ok",path="{path}"}}' in text


def test_prefill_niceness_default_follows_the_device() -> None:
    """CPU prefill workers run below the decode workers they share cores with (5); a GPU's at
    0; a given value wins; the actors apply it by role."""
    from decode_worker.actor import DecodeActor
    from pdserve.config import CPU_PREFILL_NICENESS, default_prefill_niceness
    from prefill_worker.actor import PrefillActor

    plan = serve.build_plan(parse("serve", "--device", "cpu"))
    assert plan.serve.engine.prefill_niceness == CPU_PREFILL_NICENESS == 5
    assert default_prefill_niceness("cuda") == 0
    plan = serve.build_plan(parse("serve", "--device", "cpu", "--prefill-niceness", "0"))
    assert plan.serve.engine.prefill_niceness == 0
    config = dataclasses.replace(plan.serve.engine, prefill_niceness=7)
    assert PrefillActor.niceness_for(None, config) == 7  # type: ignore[arg-type]
    assert DecodeActor.niceness_for(None, config) == 0  # type: ignore[arg-type]
