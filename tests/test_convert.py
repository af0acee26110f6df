"""`pdserve convert`: the HF directory loads in transformers and gives the GGUF's exact logits."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.commands.convert import convert, fix_config
from pdserve.config import ConfigError, ModelConfig


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_convert_smollm2_same_logits(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.tokenizer import load_tokenizer

    torch.set_num_threads(2)
    out = tmp_path / "smollm2-hf"
    result = convert("smollm2", out)  # float32: dequantised GGUF values are exact
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(
        result.files
    )
    umask = os.umask(0)
    os.umask(umask)
    modes = {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # the weights too, not 0600
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["rope_theta"] == 100000.0
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    mc = ModelConfig.from_hf(out)  # pdserve's own reader sees the same architecture
    assert (mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim) == (30, 3, 64)
    assert mc.rope_theta == 100000.0 and mc.tie_word_embeddings

    hf_tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    ours = load_tokenizer("smollm2")
    text = "The capital of France is"
    ids = ours.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    msgs = [{"role": "user", "content": "Hi"}]
    assert hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) == (
        ours.hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    )

    reloaded = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    batch = torch.tensor([ids])
    with torch.no_grad():
        want = result.model(batch).logits  # the GGUF as transformers loads it
        got = reloaded(batch).logits
    assert torch.equal(got, want)
    assert got[0, -1].argmax().item() == want[0, -1].argmax().item()


def test_convert_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert (
        main(["convert", "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "not found" in err and "\n" not in err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="exists and is not empty"):
        convert(str(hf), busy)
    assert (busy / "keep.txt").exists()


def test_fix_config(tmp_path: Path) -> None:
    p = tmp_path / "config.json"
    p.write_text(json.dumps({
        "quantization_config": {"quant_method": "gguf"}, "dtype": "float32",
        "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"},
    }))  # fmt: skip
    cfg = fix_config(p)
    assert cfg == json.loads(p.read_text())
    assert "quantization_config" not in cfg
    assert cfg["rope_theta"] == 5e5 and cfg["torch_dtype"] == "float32"
