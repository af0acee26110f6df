"""Config dataclasses validate themselves and convert HF config.json once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.config import CacheConfig, ConfigError, LoadConfig, ModelConfig, SchedulerConfig

QWEN_7B = {
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
    "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "eos_token_id": 151645,
}  # fmt: skip


def test_from_hf_qwen(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN_7B))
    cfg = ModelConfig.from_hf(tmp_path)
    assert cfg.head_dim == 128 and cfg.num_key_value_heads == 4 and cfg.attention_bias
    assert cfg.eos_token_ids == (151645,)
    assert cfg.kv_bytes_per_token * 2 == 2 * 28 * 4 * 128 * 2


def test_llama3_rope_scaling() -> None:
    d = dict(QWEN_7B, architectures=["LlamaForCausalLM"], rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})  # fmt: skip
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 8.0
    assert not cfg.attention_bias


def test_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        ModelConfig.from_hf_dict({k: v for k, v in QWEN_7B.items() if k != "num_hidden_layers"})
    with pytest.raises(ConfigError, match="architectures"):
        ModelConfig.from_hf_dict({"vocab_size": 3})
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_hf(tmp_path / "nope.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_hf(tmp_path)
    with pytest.raises(ConfigError, match="block-size"):
        CacheConfig(block_size=12)
    with pytest.raises(ConfigError, match="max-num-seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ConfigError, match="long-prefill-token-threshold must be >= 0"):
        SchedulerConfig(long_prefill_token_threshold=-1)
    with pytest.raises(ConfigError, match="dtype"):
        LoadConfig(dtype="int3")


def test_blocks_for_memory() -> None:
    cfg = ModelConfig.from_hf_dict(QWEN_7B)
    cache = CacheConfig(kv_cache_memory_bytes=2**30)
    per_block = 2 * 28 * 4 * 128 * 2 * 16
    assert cache.blocks_for(cfg, "bfloat16") == 2**30 // per_block


def test_transformers5_rope_parameters() -> None:
    """transformers 5 stores theta and scaling under `rope_parameters`."""
    d = {k: v for k, v in QWEN_7B.items() if k != "rope_theta"}
    d["architectures"] = ["LlamaForCausalLM"]
    d["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "llama3"
    d["rope_parameters"] = {"rope_theta": 1e6, "rope_type": "default"}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is None


def test_dtype_auto_follows_fast_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """--dtype auto: bf16 on CUDA and on CPUs where bf16 beats fp32 (AMX; avx512_bf16 on AMD),
    float32 on AVX2-only CPUs and on Intel CPUs with avx512_bf16 but no AMX."""
    from pdserve import config as config_mod
    from pdserve.cpu import bf16_is_fast, has_amx_bf16, parse_cpu_flags, parse_cpu_vendor

    amd, intel = "AuthenticAMD", "GenuineIntel"
    amd_avx2 = parse_cpu_flags("processor\t: 0\nflags\t\t: fpu sse avx avx2 fma\n")
    intel_amx = parse_cpu_flags("flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    avx512_bf16 = parse_cpu_flags("flags\t\t: avx2 avx512f avx512_bf16\n")
    assert not bf16_is_fast(amd_avx2, amd)
    assert bf16_is_fast(intel_amx, intel) and bf16_is_fast(avx512_bf16, amd)
    assert not bf16_is_fast(avx512_bf16, intel)  # no AMX: bf16 measured slower than fp32
    assert has_amx_bf16(intel_amx) and not has_amx_bf16(avx512_bf16)
    assert parse_cpu_flags("no flags here") == frozenset()
    cpuinfo = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\n"
    assert parse_cpu_vendor(cpuinfo) == amd and parse_cpu_vendor("") == ""

    monkeypatch.setattr(config_mod, "bf16_is_fast", lambda: False)
    assert LoadConfig().resolved_dtype == "float32"
    assert LoadConfig(device="cuda").resolved_dtype == "bfloat16"
    monkeypatch.setattr(config_mod, "bf16_is_fast", lambda: True)
    assert LoadConfig().resolved_dtype == "bfloat16"
    assert LoadConfig(dtype="float32").resolved_dtype == "float32"


def test_serve_ports_in_range() -> None:
    from pdserve.config import ServeConfig

    with pytest.raises(ConfigError, match="--port must be in 0..65535, got 99999"):
        ServeConfig(port=99999)
    with pytest.raises(ConfigError, match="--grpc-port"):
        ServeConfig(grpc_port=-1)
