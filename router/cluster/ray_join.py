"""Joining an existing Ray cluster from a router process (``pdserve serve|router --ray-address``).

Ray (2.52+) can require token authentication (``RAY_AUTH_MODE=token``; local clusters started by
``ray.init()`` have it on by default since 2.59). A process joining with an explicit address only
presents a token when ``RAY_AUTH_MODE=token`` is set in its environment; without it the join
retries for about 20 s and fails with ``InvalidAuthToken``. So, before joining:

* if ``RAY_AUTH_MODE`` is unset and a token is available to this process (``RAY_AUTH_TOKEN``,
  ``RAY_AUTH_TOKEN_PATH``, or Ray's default ``~/.ray/auth_token``, which a cluster started on this
  machine wrote), token mode is turned on for this process. Ray does the same for a local
  cluster found with ``address="auto"``; presenting a token to a cluster without authentication
  is harmless;
* a join that fails anyway raises :class:`JoinError`, one line naming the cause and the fix.

:func:`join_hint` is the line ``pdserve serve`` prints for joining from another machine.
"""

from __future__ import annotations

import logging
import shlex
from collections.abc import Sequence
from typing import Any

import ray

from pdserve import env

log = logging.getLogger(__name__)


class JoinError(RuntimeError):
    """The Ray cluster at an address could not be joined (one line: cause and fix)."""


def prepare_token_auth() -> bool:
    """Turn Ray token auth on for this process when a token is available and the mode is unset.

    Returns whether this process will present a token.
    """
    mode = env.ray_auth_mode()
    if mode is None and env.ray_auth_token_available():
        env.enable_ray_token_auth()
        _refresh_ray_config()
        return True
    return mode == "token"


def _refresh_ray_config() -> None:
    """Make this process's already-imported Ray see the new ``RAY_AUTH_MODE``.

    NOTE: Ray caches its config (and the token) when it is imported; setting the variable alone
    leaves a process that imported Ray first presenting no token, so the join fails although the
    token is right. Ray refreshes the same way when it enables token auth itself
    (``ray._private.authentication.authentication_token_setup``).
    """
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]
    except ImportError:  # another Ray layout: the variable is all we can set
        return
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _is_auth_failure(error: BaseException) -> bool:
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def join(address: str, namespace: str, **init_kwargs: Any) -> None:
    """``ray.init(address=address, namespace=namespace, **init_kwargs)`` with token handling.

    Raises JoinError (one line) when the cluster refuses this process's token or cannot be
    reached.
    """
    presents_token = prepare_token_auth()
    try:
        ray.init(address=address, namespace=namespace, **init_kwargs)
    except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError/RuntimeError/its own types
        if _is_auth_failure(e):
            have = (
                "the token this process presents is not the cluster's"
                if presents_token
                else "this process has no Ray token"
            )
            raise JoinError(
                f"cannot join the Ray cluster at {address}: it requires Ray token authentication "
                f"and {have}; set {env.RAY_AUTH_TOKEN} (or {env.RAY_AUTH_TOKEN_PATH}) to the "
                f"cluster's token (`ray get-auth-token` on the head node) and "
                f"{env.RAY_AUTH_MODE}=token"
            ) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise JoinError(
            f"cannot join the Ray cluster at {address}: {first} (is the head running, and is "
            f"{address} its GCS address as printed by `ray start --head`?)"
        ) from None


def join_hint(
    address: str,
    model: str | None = None,
    flags: Sequence[str] = (),
    ports: tuple[int, int] | None = None,
) -> str:
    """How to join this cluster from another process, as one line for the startup banner.

    ``model``: the ``--model`` the workers serve; the joining router needs the same one for its
    tokenizer and model name (its default is the bundled model). ``flags``: further arguments
    the joining router must repeat (already shell-quoted). ``ports``: this server's (HTTP, gRPC)
    ports, which a router started on the same machine must not reuse.
    """
    line = f"more routers: pdserve router --ray-address {address}"
    if model is not None and model != "smollm2":
        line += f" --model {shlex.quote(model)}"
    if flags:
        line += " " + " ".join(flags)
    if ports is not None:
        line += (
            f"   (on this machine also give it a --port and --grpc-port other than this server's "
            f"{ports[0]} and {ports[1]})"
        )
    if env.ray_auth_mode() == "token":
        line += (
            f"   (Ray token auth is on: from another machine also set {env.RAY_AUTH_MODE}=token "
            f"and {env.RAY_AUTH_TOKEN}=<`ray get-auth-token` here>)"
        )
    return line
