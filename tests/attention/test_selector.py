"""--attention-backend selection: triton on CUDA, cpu_paged on CPU, torch_ref when they cannot
run; one-line errors."""

from __future__ import annotations

import argparse
import sys

import pytest

from pdserve import env
from pdserve.attention.base import get_backend
from pdserve.attention.selector import select_attention_backend
from pdserve.commands import generate, serve
from pdserve.config import ConfigError, LoadConfig

pytestmark = pytest.mark.timeout(60)


def test_auto_is_triton_on_cuda_and_cpu_paged_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.TRITON_INTERPRET, raising=False)
    assert select_attention_backend("auto", "cuda", 128) == "triton"
    assert select_attention_backend("auto", "cuda:1", 64) == "triton"
    assert select_attention_backend("auto", "cpu", 64) == "cpu_paged"  # CI has a C compiler
    monkeypatch.setenv(env.TRITON_INTERPRET, "1")  # the interpreter is for tests, never chosen
    assert select_attention_backend("auto", "cpu", 64) == "cpu_paged"
    assert select_attention_backend("torch_ref", "cuda", 128) == "torch_ref"
    assert select_attention_backend("torch_ref", "cpu", 128) == "torch_ref"
    assert select_attention_backend("cpu_paged", "cpu", 80) == "cpu_paged"


def test_cpu_paged_without_a_compiler_falls_back_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(env.CC, "/nonexistent/cc")
    assert select_attention_backend("auto", "cpu", 64) == "torch_ref"
    (record,) = caplog.records
    assert record.levelname == "WARNING"
    assert record.getMessage() == (
        "attention backend cpu_paged cannot build its kernel: C compiler CC='/nonexistent/cc' "
        "not found; using torch_ref"
    )
    with pytest.raises(ConfigError, match="cpu_paged cannot build its kernel: C compiler") as e:
        select_attention_backend("cpu_paged", "cpu", 64)
    assert "\n" not in str(e.value) and "use --attention-backend torch_ref" in str(e.value)
    with pytest.raises(ConfigError, match="cpu_paged cannot build its kernel"):
        get_backend("cpu_paged")


def test_cpu_paged_is_for_the_cpu_only() -> None:
    with pytest.raises(
        ConfigError, match=r"cpu_paged runs on the CPU only \(--device cuda given\)"
    ):
        select_attention_backend("cpu_paged", "cuda", 64)


def test_auto_falls_back_on_cuda_when_triton_cannot_run(caplog: pytest.LogCaptureFixture) -> None:
    assert select_attention_backend("auto", "cuda", 512) == "torch_ref"
    assert "does not support head_dim 512" in caplog.text


def test_explicit_triton_that_cannot_run_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.TRITON_INTERPRET, raising=False)
    with pytest.raises(ConfigError, match=r"triton needs a CUDA device \(--device cpu given\)"):
        select_attention_backend("triton", "cpu", 64)
    monkeypatch.setenv(env.TRITON_INTERPRET, "1")
    assert select_attention_backend("triton", "cpu", 64) == "triton"
    with pytest.raises(ConfigError, match="does not support head_dim 512 .at most 256.") as e:
        select_attention_backend("triton", "cuda", 512)
    assert "\n" not in str(e.value)
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton -> ImportError
    with pytest.raises(ConfigError, match="needs the triton package"):
        select_attention_backend("triton", "cuda", 128)
    with pytest.raises(ConfigError, match="'flash' is not one of auto|torch_ref|cpu_paged|triton"):
        select_attention_backend("flash", "cuda", 128)


def test_config_field_is_validated() -> None:
    assert LoadConfig().attention_backend == "auto"
    with pytest.raises(ConfigError, match="--attention-backend 'flash' is not one of"):
        LoadConfig(attention_backend="flash")


def _parse(cmd, *argv: str) -> argparse.Namespace:  # noqa: ANN001
    parser = argparse.ArgumentParser()
    cmd.register(parser.add_subparsers())
    return parser.parse_args(list(argv))


def test_serve_fails_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(env.TRITON_INTERPRET, raising=False)
    args = _parse(serve, "serve", "--device", "cpu", "--attention-backend", "triton")
    with pytest.raises(ConfigError, match="--attention-backend triton needs a CUDA device"):
        serve.build_plan(args)
    args = _parse(serve, "serve", "--device", "cpu", "--attention-backend", "torch_ref")
    assert serve.build_plan(args).serve.engine.load.attention_backend == "torch_ref"


def test_generate_prints_one_error_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(env.TRITON_INTERPRET, raising=False)
    argv = ("generate", "--prompt", "hi", "--device", "cpu", "--attention-backend", "triton")
    assert generate.run(_parse(generate, *argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--attention-backend triton needs a CUDA device" in err
