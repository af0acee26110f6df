"""The only reader of environment variables (STYLE 3). Everything else takes values as arguments.

Variables (all optional):

- ``PDSERVE_API_KEY``: Bearer key the gateways require when ``--api-key`` is not given.
- ``PDSERVE_LOG_LEVEL``: log level name for ``pdserve`` processes (default ``INFO``).
- ``PDSERVE_RAY_ADDRESS``: Ray cluster to join when ``--ray-address`` is not given.
- ``TRITON_INTERPRET`` (Triton's own): ``1`` runs Triton kernels on CPU tensors through Triton's
  interpreter; :func:`triton_interpret` lets the ``triton`` attention backend run on CPU then.
- ``GRPC_ENABLE_FORK_SUPPORT`` (gRPC's own): set to ``0`` by :func:`configure_grpc_fork_support`
  unless already set.

Each function reads the environment when called (not at import), so tests can set variables with
``monkeypatch.setenv``.
"""

from __future__ import annotations

import logging
import os

API_KEY = "PDSERVE_API_KEY"
LOG_LEVEL = "PDSERVE_LOG_LEVEL"
RAY_ADDRESS = "PDSERVE_RAY_ADDRESS"
GRPC_FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"
TRITON_INTERPRET = "TRITON_INTERPRET"


def _get(name: str) -> str | None:
    """The variable's value stripped of surrounding spaces; None when unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def api_key() -> str | None:
    """``PDSERVE_API_KEY`` or None."""
    return _get(API_KEY)


def ray_address() -> str | None:
    """``PDSERVE_RAY_ADDRESS`` or None."""
    return _get(RAY_ADDRESS)


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value (Triton's spelling: 1, true, yes, on)."""
    return (_get(TRITON_INTERPRET) or "").lower() in ("1", "true", "yes", "on")


def log_level() -> int:
    """``PDSERVE_LOG_LEVEL`` as a ``logging`` level (default INFO).

    Raises ValueError naming the variable when the value is not a level name.
    """
    name = (_get(LOG_LEVEL) or "INFO").upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ValueError(
            f"{LOG_LEVEL}={name!r} is not a log level; use DEBUG, INFO, WARNING or ERROR"
        )
    return level


def configure_grpc_fork_support() -> None:
    """Turn gRPC's fork handlers off (``GRPC_ENABLE_FORK_SUPPORT=0``) unless the user set it.

    Call before gRPC is imported and before Ray starts (its processes inherit the variable).
    With the handlers on, every ``fork()`` while gRPC threads run logs "fork_posix.cc: Other
    threads are currently calling into gRPC, skipping fork() handlers". It is safe off because
    no pdserve process forks a child that goes on using its parent's gRPC state: children are
    fork+exec'd (Ray workers, subprocesses) and open their own channels.
    """
    os.environ.setdefault(GRPC_FORK_SUPPORT, "0")
