"""pdserve/commands/multinode_args.py: the multi-node flags of `pdserve serve` / `pdserve router`."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli import build_parser
from pdserve.commands.multinode_args import internal_token, parse_resources

pytestmark = pytest.mark.timeout(30)


def test_parse_resources() -> None:
    assert parse_resources('{"pdserve_prefill": 1}') == {"pdserve_prefill": 1.0}
    assert parse_resources("{}") == {}
    for bad, why in (
        ("pdserve_prefill", "JSON object"),
        ("[1]", "JSON object"),
        ('{"a": 0}', "number > 0"),
        ('{"a": "1"}', "number > 0"),
        ('{"a": true}', "number > 0"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            parse_resources(bad)


def test_serve_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN", raising=False)
    argv = [
        "serve", "--worker-host", "0.0.0.0",
        "--prefill-resources", '{"pdserve_prefill": 1}',
        "--decode-resources", '{"pdserve_decode": 2}',
    ]  # fmt: skip
    args = build_parser(argv).parse_args(argv)
    assert args.worker_host == "0.0.0.0"
    assert args.prefill_resources == {"pdserve_prefill": 1.0}
    assert args.decode_resources == {"pdserve_decode": 2.0}
    assert internal_token(args) is None
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "from-env")
    assert internal_token(args) == "from-env"
    args = build_parser(["serve"]).parse_args(["serve", "--internal-token", "flag"])
    assert internal_token(args) == "flag"


def test_router_has_the_token_but_no_placement_flags() -> None:
    argv = ["router", "--ray-address", "h:1", "--internal-token", "t"]
    args = build_parser(argv).parse_args(argv)
    assert args.internal_token == "t" and not hasattr(args, "prefill_resources")
    with pytest.raises(SystemExit):
        build_parser(["router"]).parse_args(["router", "--prefill-resources", "{}"])


def test_a_bad_resource_flag_names_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser(["serve"]).parse_args(["serve", "--decode-resources", '{"x": -1}'])
    assert "--decode-resources" in capsys.readouterr().err


def test_unknown_flags_show_the_subcommand_usage(capsys: pytest.CaptureFixture[str]) -> None:
    """New-user report: `pdserve serve --gpu-memory-utilization 0.5` printed the top-level
    usage; the error now names the subcommand, and help does not state a default twice."""
    from pdserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["serve", "--gpu-memory-utilization", "0.5"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pdserve serve" in err
    assert "pdserve serve: error: unrecognized arguments: --gpu-memory-utilization 0.5" in err
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert "Ray places freely)" in out and "(default: {})" not in out


def test_unknown_flags_of_a_nested_subcommand_show_its_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`pdserve bench serve --bogus` names `pdserve bench serve`, not `pdserve bench`."""
    from pdserve.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pdserve bench serve" in err
    assert "pdserve bench serve: error: unrecognized arguments: --bogus" in err
