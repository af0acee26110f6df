"""The serving suite end to end (bench/serving_suite.py, pdserve.bench.suite.runner).

* A fake vLLM peer script (the scripted fake OpenAI server for ``serve``, ``pdserve bench serve``
  standing in for vLLM's client) drives the whole orchestration in seconds: every run, file,
  floor, chart and report section, and a failing server recorded without losing the others.
* The CLI's argument errors (missing peer script: one line, exit 2).
* ``--quick`` against a real ``pdserve serve`` of a tiny random-weight model (e2e, slow).

No timing is asserted: only that every run completes and is reported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from pdserve.bench.datasets import random_requests
from pdserve.bench.report import load_result
from pdserve.bench.suite.runner import SuiteConfig, run_suite
from pdserve.bench.suite.vllm_peer import VllmPeer
from pdserve.bench.suite.workloads import QUICK_MAIN, SEED_MAIN
from pdserve.bench.word_tokenizer import WordTokenizer
from pdserve.cli import build_parser
from pdserve.commands.bench import build_requests

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]
FAKE_SERVER = Path(__file__).with_name("fake_openai.py")
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def _serving_suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "serving_suite", ROOT / "bench" / "serving_suite.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_model(path: Path) -> Path:
    """A config.json of a tiny Llama (random weights via --load-format dummy)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return path


def _fake_peer(tmp_path: Path, serve_fails: bool = False) -> VllmPeer:
    """A peer script: ``serve PORT`` runs the fake server, ``bench`` runs `pdserve bench serve`
    with vLLM's extra flags dropped, ``hf`` names the builtin tokenizer."""
    script = tmp_path / "fake-peer.sh"
    (tmp_path / "fake.json").write_text(json.dumps({"default": {"ttft_ms": 30,
                                                               "itl_ms": [20] * 9}}))  # fmt: skip
    serve = (
        "exit 1"
        if serve_fails
        else f'exec {sys.executable} {FAKE_SERVER} {tmp_path}/fake.json "$2"'
    )
    script.write_text(f"""#!/bin/bash
set -eu
case "$1" in
  serve) {serve} ;;
  hf) echo builtin ;;
  bench) shift; args=()
    while [ $# -gt 0 ]; do
      case "$1" in
        --backend) shift 2 ;;
        --save-detailed) shift ;;
        *) args+=("$1"); shift ;;
      esac
    done
    cd {ROOT} && exec {sys.executable} -m pdserve.cli bench serve "${{args[@]}}" ;;
esac
""")
    os.chmod(script, 0o755)
    return VllmPeer(script)


def _config(tmp_path: Path, peer: VllmPeer, **kw: Any) -> SuiteConfig:
    return SuiteConfig(
        out_dir=tmp_path / "results", dtype="float32", model=str(_tiny_model(tmp_path / "tiny")),
        load_format="dummy", tokenizer="builtin", modes=(), quick=True, peer=peer,
        ready_timeout_s=60, request_timeout_s=60, measure_reps=1, **kw,
    )  # fmt: skip


def test_suite_against_a_fake_peer(tmp_path: Path) -> None:
    lines: list[str] = []
    report, errors = run_suite(_config(tmp_path, _fake_peer(tmp_path)), echo=lines.append)
    out = tmp_path / "results"
    assert errors == [] and report == out / "report.md"
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["run"]: r for r in summary["runs"]}
    assert set(runs) == {"main", "main-vllm-client", "short-alone", "short-mixed", "long-mixed",
                         "mixed-both-clients"}  # fmt: skip
    assert all(r["server"] == "vllm" for r in summary["runs"])
    assert (
        runs["main"]["summary"]["completed"]
        == 16
        == runs["main-vllm-client"]["summary"]["completed"]
    )
    assert runs["short-mixed"]["summary"]["completed"] == 8
    assert runs["long-mixed"]["summary"]["completed"] >= 1
    for r in summary["runs"]:
        if r["file"]:
            doc = load_result(out / r["file"])  # validated result files
            assert doc["failed"] == 0
    # 16 requests x 9 decode steps (10 tokens each), 8 at a time
    assert runs["main"]["floors"]["decode_steps"] == 18
    assert runs["main"]["floors"]["duration_over_floor"] > 0
    assert runs["mixed-both-clients"]["floors"]["duration_s"] > 0
    assert summary["machine"]["dtype"] == "float32" and summary["servers"]["vllm"]["ready_s"] >= 0
    assert summary["servers"]["vllm"]["exit_code"] is not None  # stopped
    assert (out / "plots" / "main" / "latency_cdf.png").is_file()
    assert (out / "plots" / "mixed" / "latency_cdf.png").is_file()
    assert (out / "logs" / "vllm.log").is_file() and (out / "machine.json").is_file()
    text = report.read_text()
    for section in ("## Machine", "## Main workload", "## Mixed workload",
                    "## Clients compared (main workload)", "## Floors", "## Plots"):  # fmt: skip
        assert section in text
    assert "| workload | vLLM |" in text and "| vllm bench |" in text
    assert any("vllm main (pdserve client): 16 ok / 0 failed" in line for line in lines)
    commands = summary["servers"]["vllm"]["client_commands"]
    assert len(commands) == 4 and "bench --backend openai-chat" in commands[1]
    assert all(f"`{c}`" in text for c in commands)
    # the printed `pdserve bench serve` line rebuilds exactly the prompts the suite sent
    argv = shlex.split(commands[0])
    assert argv[:3] == ["pdserve", "bench", "serve"]
    args = build_parser(argv[1:]).parse_args(argv[1:])
    rebuilt = build_requests(args, WordTokenizer())
    w = QUICK_MAIN  # the suite's prompts, built as Suite.prepare builds them
    suite_prompts = random_requests(
        WordTokenizer(), w.num_prompts, w.input_len, w.output_len, seed=0 + SEED_MAIN
    )
    assert [r.prompt for r in rebuilt] == [r.prompt for r in suite_prompts]
    assert [r.output_len for r in rebuilt] == [32] * 16
    assert args.ignore_eos and args.max_concurrency == 8 and args.seed == 0
    short_argv = shlex.split(commands[2])[1:]
    short = build_requests(build_parser(short_argv).parse_args(short_argv), WordTokenizer())
    assert len(short) == 8 and {r.prompt for r in short}.isdisjoint(r.prompt for r in rebuilt)


def test_a_failing_server_is_reported_and_the_run_goes_on(tmp_path: Path) -> None:
    config = _config(tmp_path, _fake_peer(tmp_path, serve_fails=True), workloads=("main",))
    report, errors = run_suite(config, echo=lambda _line: None)
    assert len(errors) == 1 and errors[0].startswith("vllm: ServerError: vllm exited with 1")
    text = report.read_text()
    assert "## Errors" in text and "## Main workload" not in text


def test_cli_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    suite = _serving_suite()
    assert suite.main(["--with-vllm", "--vllm-peer", "/nonexistent/peer.sh"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vLLM peer script not found" in err
    assert "/nonexistent/peer.sh" in err
    with pytest.raises(SystemExit) as info:
        suite.parse_args(["--modes", "both"])
    assert info.value.code == 2
    assert "--modes: both not in disaggregated, unified" in capsys.readouterr().err
    args = suite.parse_args(["--modes", "unified", "--workloads", "main", "--quick"])
    assert args.modes == ("unified",) and args.workloads == ("main",) and args.quick
    assert suite.resolve_dtype("auto", "smollm2") in ("float32", "bfloat16")
    assert suite.resolve_dtype("float32", "smollm2") == "float32"


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_suite_on_a_tiny_pdserve(tmp_path: Path) -> None:
    """`serving_suite.py --quick` against `pdserve serve` (disaggregated) of a tiny random model:
    both workloads complete and are reported."""
    from pdserve.tokenizer import load_tokenizer

    model = _tiny_model(tmp_path / "tiny")
    load_tokenizer("smollm2").hf.save_pretrained(str(model))  # the tokenizer, not the weights
    out = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serving_suite.py"), "--quick", "--model",
         str(model), "--load-format", "dummy", "--dtype", "float32", "--modes", "disaggregated",
         "--result-dir", str(out), "--serve-arg=--kv-cache-memory-bytes=268435456",
         "--long-num-prompts", "3"],
        cwd=ROOT, capture_output=True, text=True, timeout=840,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    runs = {r["run"]: r for r in summary["runs"]}
    assert {"main", "short-alone", "short-mixed", "long-mixed"} <= set(runs)
    assert all(r["server"] == "pdserve-disaggregated" for r in summary["runs"])
    assert runs["main"]["summary"]["completed"] == 16 and runs["main"]["summary"]["failed"] == 0
    assert runs["short-mixed"]["summary"]["completed"] == 8
    assert runs["long-mixed"]["summary"]["failed"] == 0
    assert runs["long-mixed"]["summary"]["completed"] <= 3  # --long-num-prompts
    assert summary["config"]["mixed_workload"]["long_num_prompts"] == 3
    assert summary["servers"]["pdserve-disaggregated"]["exit_code"] is not None
    report = (out / "report.md").read_text()
    assert "| workload | pdserve disaggregated |" in report and "(at most 3)" in report
