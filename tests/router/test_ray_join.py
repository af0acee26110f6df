"""router/cluster/ray_join.py: Ray token auth before joining, and one-line join errors (no Ray started)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import ray

from router.cluster import ray_join
from router.cluster.ray_join import JoinError, join, join_hint, prepare_token_auth

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    return tmp_path


def test_no_token_anywhere_leaves_the_mode_alone(clean_env: Path) -> None:
    assert prepare_token_auth() is False and "RAY_AUTH_MODE" not in os.environ


def test_a_token_file_turns_token_mode_on(clean_env: Path) -> None:
    (clean_env / ".ray").mkdir()
    (clean_env / ".ray" / "auth_token").write_text("abc\n")
    assert prepare_token_auth() is True and os.environ["RAY_AUTH_MODE"] == "token"


def test_token_env_and_path_count_and_an_explicit_mode_wins(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RAY_AUTH_TOKEN", "t")
    assert prepare_token_auth() is True
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert prepare_token_auth() is False
    monkeypatch.delenv("RAY_AUTH_MODE")
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    (clean_env / "tok").write_text("x")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(clean_env / "tok"))
    assert prepare_token_auth() is True


def _failing_init(error: BaseException) -> Any:
    def init(**_kwargs: Any) -> None:
        raise error

    return init


def test_an_auth_failure_is_one_line_naming_the_fix(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cause = ray.exceptions.AuthenticationError("RPC error: InvalidAuthToken: missing")
    outer = ConnectionError("Failed to connect to Ray cluster at 10.0.0.5:6379")
    outer.__cause__ = cause
    monkeypatch.setattr(ray_join.ray, "init", _failing_init(outer))
    with pytest.raises(JoinError) as err:
        join("10.0.0.5:6379", "pdserve")
    text = str(err.value)
    assert "\n" not in text
    assert "requires Ray token authentication and this process has no Ray token" in text
    assert "RAY_AUTH_TOKEN" in text and "ray get-auth-token" in text


def test_other_failures_name_the_address(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        ray_join.ray, "init", _failing_init(ConnectionError("could not reach GCS\nmore"))
    )
    with pytest.raises(
        JoinError, match=r"^cannot join the Ray cluster at h:1: could not reach GCS"
    ):
        join("h:1", "pdserve")


def test_join_hint(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert join_hint("1.2.3.4:6379") == "more routers: pdserve router --ray-address 1.2.3.4:6379"
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert "RAY_AUTH_TOKEN" in join_hint("1.2.3.4:6379")


def test_join_hint_names_the_ports_a_router_on_this_machine_must_avoid(clean_env: Path) -> None:
    line = join_hint("1.2.3.4:6379", ports=(8000, 50051))
    assert line.startswith("more routers: pdserve router --ray-address 1.2.3.4:6379   (")
    assert "--port and --grpc-port other than this server's 8000 and 50051" in line


def test_join_hint_names_the_model(clean_env: Path) -> None:
    """The printed router line carries --model when the workers serve another model."""
    assert join_hint("1.2.3.4:6379", "smollm2").endswith("--ray-address 1.2.3.4:6379")
    line = join_hint("1.2.3.4:6379", "/models/my model")
    assert "--ray-address 1.2.3.4:6379 --model '/models/my model'" in line
