"""`pdserve plan`: seed-formula KV bytes, admitted concurrency, one-line errors for bad configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.config import ConfigError
from pdserve.plan import format_bytes, load_model_config, plan_kv

# Qwen2.5-7B-Instruct: 28 layers, 28 query heads over hidden 3584 (head_dim 128), 4 KV heads.
QWEN_7B = {
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
}  # fmt: skip


@pytest.fixture
def qwen_config(tmp_path: Path) -> Path:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(QWEN_7B))
    return p


def test_qwen_7b_cli_prints_seed_number(qwen_config: Path, capsys: pytest.CaptureFixture) -> None:
    rc = main(
        ["plan", "--config", str(qwen_config), "--tokens", "32768", "--batch", "8", "--dtype",
         "bfloat16"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "15,032,385,536 bytes (14.0 GiB)" in out
    assert "57,344 bytes" in out  # per token: 2 * 28 * 4 * 128 * 2


def test_formula_and_dtype_aliases(qwen_config: Path) -> None:
    model = load_model_config(qwen_config.parent)  # a directory works too
    for dtype, elem in (("float32", 4), ("fp32", 4), ("bf16", 2), ("float16", 2)):
        plan = plan_kv(model, tokens=1000, batch=3, dtype=dtype)
        assert plan.total_bytes == 2 * 28 * 4 * 128 * elem * 1000 * 3
    assert format_bytes(15_032_385_536) == "15,032,385,536 bytes (14.0 GiB)"


def test_memory_budget_admits_whole_blocks(
    qwen_config: Path, capsys: pytest.CaptureFixture
) -> None:
    model = load_model_config(qwen_config)
    # One 32768-token bf16 sequence is 1,879,048,192 bytes = 1.75 GiB; 14 GiB holds exactly 8.
    plan = plan_kv(model, tokens=32768, dtype="bfloat16", memory_gib=14.0)
    assert plan.max_concurrency == 8
    assert plan.num_blocks == 14 * 1024**3 // (57344 * 16)
    # 17 tokens need 2 blocks of 16: 14 GiB / (2 blocks) sequences.
    plan17 = plan_kv(model, tokens=17, dtype="bfloat16", memory_gib=14.0)
    assert plan17.max_concurrency == plan17.num_blocks // 2
    rc = main(["plan", "--config", str(qwen_config), "--tokens", "32768", "--memory-gib", "14"])
    assert rc == 0
    assert "admits 8 concurrent sequences of 32,768 tokens" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "must hold a JSON object"),
        (json.dumps({"vocab_size": 1}), "'architectures'"),
        (json.dumps({k: v for k, v in QWEN_7B.items() if k != "num_hidden_layers"}),
         "'num_hidden_layers'"),
        (json.dumps(dict(QWEN_7B, hidden_size="big")), "bad value"),
        (json.dumps(dict(QWEN_7B, num_key_value_heads=5)), "num_key_value_heads"),
    ],
)  # fmt: skip
def test_bad_config_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: str, needle: str
) -> None:
    p = tmp_path / "config.json"
    p.write_text(content)
    rc = main(["plan", "--config", str(p), "--tokens", "16"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert needle in err and "\n" not in err and str(p) in err


def test_bad_arguments(qwen_config: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(["plan", "--config", str(qwen_config.parent / "missing.json"), "--tokens", "1"]) == 2
    )
    assert "file not found" in capsys.readouterr().err
    assert main(["plan", "--config", str(qwen_config), "--tokens", "0"]) == 2
    assert "--tokens must be > 0" in capsys.readouterr().err
    assert main(["plan", "--config", str(qwen_config), "--tokens", "8", "--dtype", "int4"]) == 2
    assert "--dtype" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--memory-gib"):
        plan_kv(load_model_config(qwen_config), tokens=8, memory_gib=0)


def test_the_bundled_model_and_a_gguf_plan_like_a_config(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """--config takes what --model takes (smollm2, a .gguf) besides a config.json, and says when
    the length is past the model's context."""
    from pdserve.model.resolve import smollm2_path

    rc = main(["plan", "--config", "smollm2", "--tokens", "32768"])
    out = capsys.readouterr().out
    assert rc == 0
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64 -> 2 * 30 * 3 * 64 * 2 bytes per token
    assert "23,040 bytes" in out and "past the model's context length (8,192 tokens" in out
    assert main(["plan", "--config", str(smollm2_path()), "--tokens", "100"]) == 0
    assert "23,040 bytes" in capsys.readouterr().out
    assert main(["plan", "--config", str(tmp_path / "none.gguf"), "--tokens", "100"]) == 2
    assert "not found" in capsys.readouterr().err
