"""The committed gRPC stubs match the .proto files, and rpc.py round-trips core dataclasses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import rpc
from pdserve.sampling_params import SamplingError, SamplingParams
from pdserve.types import SampledToken
from pdserve.v1 import common_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
PROTOS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto/pdserve/v1").glob("*.proto"))


@pytest.mark.timeout(60)
def test_stubs_are_up_to_date(tmp_path: Path) -> None:
    """`make proto` output equals what is committed in pdserve/v1/."""
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", "-Iproto",
        f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}",
        *PROTOS,
    ]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated, "protoc produced nothing"
    for rel in generated:
        committed = ROOT / rel
        assert committed.is_file(), f"{rel} is generated but not committed; run `make proto`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), (
            f"{rel} differs from the .proto files; run `make proto` and commit"
        )


def test_every_proto_field_is_commented() -> None:
    """STYLE 6: every field of a cross-process message carries a comment."""
    for name in PROTOS:
        for lineno, line in enumerate((ROOT / name).read_text().splitlines(), 1):
            s = line.strip()
            if s.endswith(";") and "=" in s and not s.startswith(("syntax", "option")):
                nxt = s.split(";", 1)[1]
                assert "//" in line or "//" in nxt, f"{name}:{lineno} field without a comment"


def test_sampling_round_trip() -> None:
    p = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=0.5,
        frequency_penalty=-0.5, repetition_penalty=1.1, seed=42, max_tokens=12, min_tokens=2,
        stop_token_ids=(5, 7), ignore_eos=True, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    back = rpc.sampling_from_proto(pb.SamplingParams.FromString(
        rpc.sampling_to_proto(p).SerializeToString()))  # fmt: skip
    for field in ("top_k", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos",
                  "logprobs", "top_logprobs"):  # fmt: skip
        assert getattr(back, field) == getattr(p, field), field
    for field in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty"):  # fmt: skip
        assert getattr(back, field) == pytest.approx(getattr(p, field)), field


def test_range_edges_survive_the_float32_wire() -> None:
    """The documented lower limit of repetition_penalty (1e-4, not a float32) and a positive
    top_p below float32's range reach the worker as valid values, not as an error or "unset"."""
    for p in (
        SamplingParams(repetition_penalty=1e-4, max_tokens=4),
        SamplingParams(top_p=1e-50, max_tokens=4),
    ):
        back = rpc.sampling_from_proto(pb.SamplingParams.FromString(
            rpc.sampling_to_proto(p).SerializeToString()))  # fmt: skip
        assert back.repetition_penalty == pytest.approx(p.repetition_penalty)
        assert 0 < back.top_p <= max(p.top_p, 1e-44)


def test_unseeded_stays_unseeded() -> None:
    m = rpc.sampling_to_proto(SamplingParams(max_tokens=3))
    assert rpc.sampling_from_proto(m).seed is None


def test_bad_wire_values_name_the_field() -> None:
    m = pb.SamplingParams(temperature=-1.0, max_tokens=4)
    with pytest.raises(SamplingError) as e:
        rpc.sampling_from_proto(m)
    assert e.value.field == "temperature"
    with pytest.raises(SamplingError) as e:
        rpc.sampling_from_proto(pb.SamplingParams(max_tokens=0))
    assert e.value.field == "max_tokens"
    with pytest.raises(SamplingError):
        rpc.sampling_to_proto(SamplingParams(max_tokens=None))


def test_token_round_trip() -> None:
    t = SampledToken(token_id=9, logprob=-0.25, top_logprobs=((9, -0.25), (3, -1.5)))
    back = rpc.token_from_proto(
        pb.TokenLogprob.FromString(rpc.token_to_proto(t).SerializeToString())
    )
    assert back == t
