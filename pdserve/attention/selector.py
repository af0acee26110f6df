"""Which attention backend a worker runs: ``--attention-backend`` resolved against the device.

Policy: ``auto`` picks ``triton`` on CUDA and ``cpu_paged`` on CPU (paged kernels that read K/V
through the block table); it falls back to ``torch_ref`` with one warning when the chosen
kernels cannot run here (triton missing or head size too large on CUDA; no C compiler or a
failed build on CPU), as vLLM's automatic choice falls back. An explicit ``triton`` or
``cpu_paged`` that cannot run fails at startup with one line.
"""

from __future__ import annotations

import logging

from pdserve import env
from pdserve.attention import cpu_kernels
from pdserve.attention.triton_kernels import MAX_HEAD_DIM
from pdserve.config import ATTENTION_BACKENDS, ConfigError

log = logging.getLogger(__name__)


def triton_unsupported(device: str, head_dim: int) -> str | None:
    """Why the ``triton`` backend cannot run a model of ``head_dim`` on ``device``, or None."""
    if head_dim > MAX_HEAD_DIM:
        return f"does not support head_dim {head_dim} (at most {MAX_HEAD_DIM})"
    try:
        import triton  # noqa: F401
    except ImportError as e:  # pragma: no cover - triton is a dependency
        return f"needs the triton package, which failed to import ({e})"
    if not device.startswith("cuda") and not env.triton_interpret():
        return (
            f"needs a CUDA device (--device {device} given); set TRITON_INTERPRET=1 to run its "
            "kernels on CPU (slow: for tests)"
        )
    return None


def cpu_paged_unsupported(device: str) -> str | None:
    """Why the ``cpu_paged`` backend cannot run on ``device``, or None. Builds (or finds in the
    cache) its kernel library on first call."""
    if device.split(":")[0] != "cpu":
        return f"runs on the CPU only (--device {device} given)"
    kl = cpu_kernels.load()
    return None if kl.lib is not None else f"cannot build its kernel: {kl.reason}"


def select_attention_backend(requested: str, device: str, head_dim: int) -> str:
    """The backend name for ``--attention-backend requested`` on ``device`` ('cpu', 'cuda',
    'cuda:N') for a model of ``head_dim``: 'torch_ref', 'cpu_paged' or 'triton'.

    Raises ConfigError (one line naming the flag) for an unknown name, an explicit ``triton``
    that cannot run here (no CUDA device and no ``TRITON_INTERPRET=1``, head_dim above
    MAX_HEAD_DIM, triton not importable) or an explicit ``cpu_paged`` that cannot (not on the
    CPU, or its kernel does not build).
    """
    if requested not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"--attention-backend {requested!r} is not one of {'|'.join(ATTENTION_BACKENDS)}"
        )
    if requested == "torch_ref":
        return requested
    if requested == "cpu_paged" or (requested == "auto" and not device.startswith("cuda")):
        why = cpu_paged_unsupported(device)
        if why is None:
            return "cpu_paged"
        if requested == "cpu_paged":
            raise ConfigError(
                f"--attention-backend cpu_paged {why}; use --attention-backend torch_ref"
            )
        log.warning("attention backend cpu_paged %s; using torch_ref", why)
        return "torch_ref"
    why = triton_unsupported(device, head_dim)
    if why is None:
        return "triton"
    if requested == "triton":
        raise ConfigError(f"--attention-backend triton {why}; use --attention-backend torch_ref")
    log.warning("attention backend triton %s; using torch_ref", why)
    return "torch_ref"
