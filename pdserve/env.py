"""The only reader of environment variables (STYLE 3). Everything else takes values as arguments.

Variables (all optional):

- ``PDSERVE_API_KEY``: Bearer key the gateways require when ``--api-key`` is not given.
- ``PDSERVE_LOG_LEVEL``: log level name for ``pdserve`` processes (default ``INFO``).
- ``PDSERVE_RAY_ADDRESS``: Ray cluster to join when ``--ray-address`` is not given.
- ``PDSERVE_INTERNAL_TOKEN``: shared secret of worker gRPC calls and KV handshakes when
  ``--internal-token`` is not given (pdserve/auth.py).
- ``GLOO_SOCKET_IFNAME`` (gloo's own): the network interface KV pair channels use on CPU.
- ``RAY_AUTH_MODE``, ``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH`` (Ray's own token authentication):
  read to tell whether a process joining a cluster can present a token (router/cluster/ray_join.py).
- ``TRITON_INTERPRET`` (Triton's own): ``1`` runs Triton kernels on CPU tensors through Triton's
  interpreter; :func:`triton_interpret` lets the ``triton`` attention backend run on CPU then.
- ``PDSERVE_KERNEL_CACHE``: directory of pdserve's compiled CPU kernels (default
  ``$XDG_CACHE_HOME/pdserve/kernels``, else ``~/.cache/pdserve/kernels``).
- ``CC`` (the usual C compiler variable): the compiler of those kernels (default ``cc``, else
  ``gcc``, found on ``PATH``).
- ``PDSERVE_CPU_SKINNY_GEMM``: ``0`` turns off the few-row fp32 and bf16 linear kernels
  (pdserve/model/cpu_linear.py) and with them the second copy of the weights they hold.
- ``PDSERVE_CPU_WEIGHT_CODES``: ``0`` keeps fp32 panels for those kernels where a weight could be
  held exactly as GGUF-style integer codes (``skinny_pack_codes`` in pdserve/model/cpu_linear.py).
- ``PDSERVE_CPU_SAMPLING_KERNEL``: ``0`` makes the sampler use its torch path on the CPU instead
  of the C race and argmax kernel (pdserve/sampling_cpu.py).
- ``PDSERVE_CPU_FUSED_DECODE``: ``0`` makes decode-only CPU steps run the model's forward instead
  of the one-call C step (pdserve/model/cpu_decode.py).
- ``PDSERVE_CPU_DECODE_HELPER``: ``0`` keeps that C step on its own thread, without the
  idle-priority helper thread it otherwise shares its matmuls and attention with.
- ``PDSERVE_CPU_PREFILL_HELPER``: how a prefill worker shares its matmuls with a helper thread
  (pdserve/model/cpu_linear.py): ``0`` (or ``off``) never, ``idle`` with the helper at
  ``SCHED_IDLE``, a niceness ``1``-``19`` with the helper at that niceness; unset or ``auto``:
  the measured default for this CPU.
- ``GRPC_ENABLE_FORK_SUPPORT`` (gRPC's own): set to ``0`` by :func:`configure_grpc_fork_support`
  unless already set.

Each function reads the environment when called (not at import), so tests can set variables with
``monkeypatch.setenv``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

API_KEY = "PDSERVE_API_KEY"
LOG_LEVEL = "PDSERVE_LOG_LEVEL"
RAY_ADDRESS = "PDSERVE_RAY_ADDRESS"
INTERNAL_TOKEN = "PDSERVE_INTERNAL_TOKEN"
GLOO_SOCKET_IFNAME = "GLOO_SOCKET_IFNAME"
RAY_AUTH_MODE = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH = "RAY_AUTH_TOKEN_PATH"
GRPC_FORK_SUPPORT = "GRPC_ENABLE_FORK_SUPPORT"
TRITON_INTERPRET = "TRITON_INTERPRET"
KERNEL_CACHE = "PDSERVE_KERNEL_CACHE"
XDG_CACHE_HOME = "XDG_CACHE_HOME"
CC = "CC"
CPU_SKINNY_GEMM = "PDSERVE_CPU_SKINNY_GEMM"
CPU_WEIGHT_CODES = "PDSERVE_CPU_WEIGHT_CODES"
CPU_SAMPLING_KERNEL = "PDSERVE_CPU_SAMPLING_KERNEL"
CPU_FUSED_DECODE = "PDSERVE_CPU_FUSED_DECODE"
CPU_DECODE_HELPER = "PDSERVE_CPU_DECODE_HELPER"
CPU_PREFILL_HELPER = "PDSERVE_CPU_PREFILL_HELPER"


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


def internal_token() -> str | None:
    """``PDSERVE_INTERNAL_TOKEN`` or None."""
    return _get(INTERNAL_TOKEN)


def gloo_socket_ifname() -> str | None:
    """``GLOO_SOCKET_IFNAME`` (first name of a comma-separated list) or None."""
    value = _get(GLOO_SOCKET_IFNAME)
    if value is None:
        return None
    return value.split(",")[0].strip() or None


def ray_auth_mode() -> str | None:
    """``RAY_AUTH_MODE`` lower-cased ('token', 'disabled', ...) or None when unset."""
    value = _get(RAY_AUTH_MODE)
    return value.lower() if value else None


def ray_auth_token_available() -> bool:
    """Whether Ray would find a token for this process: ``RAY_AUTH_TOKEN``, a readable
    ``RAY_AUTH_TOKEN_PATH``, or Ray's default file ``~/.ray/auth_token`` (Ray's order)."""
    if _get(RAY_AUTH_TOKEN):
        return True
    path = _get(RAY_AUTH_TOKEN_PATH)
    candidate = Path(path) if path else Path.home() / ".ray" / "auth_token"
    try:
        return bool(candidate.read_text().strip())
    except OSError:
        return False


def enable_ray_token_auth() -> None:
    """Set ``RAY_AUTH_MODE=token`` for this process and its children (call before ray.init)."""
    os.environ[RAY_AUTH_MODE] = "token"


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET`` is set to a true value (Triton's spelling: 1, true, yes, on)."""
    return (_get(TRITON_INTERPRET) or "").lower() in ("1", "true", "yes", "on")


def kernel_cache_dir() -> Path:
    """Where compiled CPU kernels are cached: ``PDSERVE_KERNEL_CACHE``, else
    ``$XDG_CACHE_HOME/pdserve/kernels``, else ``~/.cache/pdserve/kernels`` (not created here)."""
    explicit = _get(KERNEL_CACHE)
    if explicit:
        return Path(explicit).expanduser()
    base = _get(XDG_CACHE_HOME)
    return (Path(base) if base else Path.home() / ".cache") / "pdserve" / "kernels"


def c_compiler() -> str | None:
    """``CC`` as given (a command name or path, possibly not existing), or None when unset."""
    return _get(CC)


def cpu_skinny_gemm() -> bool:
    """False when ``PDSERVE_CPU_SKINNY_GEMM`` is ``0``, ``false``, ``no`` or ``off``; else True."""
    return _flag(CPU_SKINNY_GEMM)


def cpu_weight_codes() -> bool:
    """False when ``PDSERVE_CPU_WEIGHT_CODES`` is ``0``, ``false``, ``no`` or ``off``; else True."""
    return _flag(CPU_WEIGHT_CODES)


def cpu_sampling_kernel() -> bool:
    """False when ``PDSERVE_CPU_SAMPLING_KERNEL`` is ``0``, ``false``, ``no`` or ``off``; else
    True."""
    return _flag(CPU_SAMPLING_KERNEL)


def cpu_fused_decode() -> bool:
    """False when ``PDSERVE_CPU_FUSED_DECODE`` is ``0``, ``false``, ``no`` or ``off``; else True."""
    return _flag(CPU_FUSED_DECODE)


def cpu_decode_helper() -> bool:
    """False when ``PDSERVE_CPU_DECODE_HELPER`` is ``0``, ``false``, ``no`` or ``off``; else True
    (the fused decode step shares its matmuls and attention with an idle-priority helper thread:
    :mod:`pdserve.model.cpu_decode`)."""
    return _flag(CPU_DECODE_HELPER)


def cpu_prefill_helper() -> str | int | None:
    """``PDSERVE_CPU_PREFILL_HELPER``: None (unset or ``auto``), ``"off"`` (``0``, ``false``,
    ``no``, ``off``), ``"idle"``, or a niceness 1-19 (int). Raises ValueError for anything
    else."""
    value = (_get(CPU_PREFILL_HELPER) or "auto").lower()
    if value == "auto":
        return None
    if value in ("0", "false", "no", "off"):
        return "off"
    if value == "idle":
        return "idle"
    if value.isdigit() and 1 <= int(value) <= 19:
        return int(value)
    raise ValueError(
        f"{CPU_PREFILL_HELPER} must be auto, off, idle or a niceness 1-19, got {value!r}"
    )


def _flag(name: str) -> bool:
    """An on/off variable that defaults to on: off for ``0``, ``false``, ``no`` or ``off``."""
    return (_get(name) or "1").lower() not in ("0", "false", "no", "off")


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
