"""Compile a C kernel source into a shared library on first use, cache it, load it with ctypes.

Lifecycle of one source (e.g. ``cpu_kernels/paged_decode.c``) in a process:

1. :func:`load_library` looks for ``<cache>/<stem>-<key>.so``. The key hashes everything the
   binary depends on: the source text (with the files it includes by ``#include "..."``), the
   compiler (command, ``--version``, target triple),
   the flags, and the CPU (``-march=native`` code is only valid on a CPU with the same
   features), so a cache shared by machines or compilers never hands out a wrong binary.
2. Missing: the compiler (``CC``, else ``cc``, else ``gcc`` on ``PATH``) writes a temporary file
   in the cache directory, which is then renamed onto the final name. Rename is atomic, so two
   processes compiling at once both succeed and neither ever loads a half-written library.
   Flags: ``-O3 -march=native -fopenmp``; when that fails, the same without OpenMP (the kernel
   then runs on one thread), then for the generic target of the compiler (no ``-march=native``:
   slower vector code), then without both; a warning names what was left out and why.
3. ``ctypes.CDLL`` loads it (ctypes releases the GIL for the duration of each call).

Any failure (no compiler, a compile error, an unwritable cache, a load error) returns a
:class:`KernelLibrary` with ``lib`` None and a one-line ``reason``; callers fall back to their
pure-torch path. Results are memoised per (source, compiler, cache directory) for the process.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve import env

log = logging.getLogger(__name__)

BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-std=gnu11")
OPENMP_FLAG = "-fopenmp"
NATIVE_FLAG = "-march=native"
# tried in order until one builds
FLAG_VARIANTS = ((NATIVE_FLAG, OPENMP_FLAG), (NATIVE_FLAG,), (OPENMP_FLAG,), ())
LIBS = ("-lm",)
COMPILE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class KernelLibrary:
    """The outcome of :func:`load_library`: ``lib`` (None on failure) and why it is None.

    ``path``: the cached library file; ``flags``: the optional flags it was built with (see
    FLAG_VARIANTS); ``compiled``: whether this call compiled it (False: cache hit).
    """

    lib: ctypes.CDLL | None
    reason: str | None = None
    path: Path | None = None
    flags: tuple[str, ...] = ()
    compiled: bool = False

    @property
    def openmp(self) -> bool:
        """Built with OpenMP (else every call runs on one thread)."""
        return OPENMP_FLAG in self.flags


_lock = threading.Lock()
_loaded: dict[tuple[str, str, str], KernelLibrary] = {}
# the same libraries by source and the raw variables the cache key derives from: the per-layer
# callers (the KV write, prefill attention) look a library up ~60 times a prefill step, and
# building the key's paths took ~11 us a look-up
_by_env: dict[tuple[str, ...], KernelLibrary] = {}
_KEY_VARIABLES = (env.CC, env.KERNEL_CACHE, env.XDG_CACHE_HOME, "HOME")


def find_compiler() -> tuple[list[str] | None, str | None]:
    """The C compiler command (``CC`` split like a shell word list, else ``cc`` or ``gcc`` on
    PATH) and None, or None and why there is none."""
    given = env.c_compiler()
    if given is not None:
        cmd = shlex.split(given)
        if not cmd or shutil.which(cmd[0]) is None:
            return None, f"C compiler CC={given!r} not found"
        return cmd, None
    for name in ("cc", "gcc"):
        path = shutil.which(name)
        if path is not None:
            return [path], None
    return None, "no C compiler (cc or gcc) on PATH; set CC"


def _cpu_identity() -> str:
    """The CPU model and feature flags (what ``-march=native`` compiles for)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n\n", 1)[0].splitlines()
        return "\n".join(ln for ln in lines if ln.startswith(("model name", "flags", "Features")))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _compiler_identity(cc: list[str]) -> str:
    """The command, its ``--version`` and ``-dumpmachine`` output (raises OSError or
    subprocess.SubprocessError)."""
    out = [shlex.join(cc)]
    for arg in ("--version", "-dumpmachine"):
        proc = subprocess.run([*cc, arg], capture_output=True, text=True, timeout=60, check=True)
        out.append(proc.stdout.strip())
    return "\n".join(out)


_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.MULTILINE)


def source_text(src: Path) -> bytes:
    """``src``'s bytes followed by those of every file it includes with ``#include "..."``
    (resolved next to the including file, recursively, each once): what the binary depends on.
    Raises OSError when one cannot be read."""
    seen: set[Path] = set()
    parts: list[bytes] = []

    def add(path: Path) -> None:
        path = path.resolve()
        if path in seen:
            return
        seen.add(path)
        text = path.read_bytes()
        parts.append(text)
        for name in _LOCAL_INCLUDE.findall(text):
            add(path.parent / name.decode())

    add(src)
    return b"\0".join(parts)


def _cache_key(source: bytes, cc_identity: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for part in (source, cc_identity.encode(), " ".join(flags).encode(), _cpu_identity().encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()[:20]


def _first_error_line(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(no output)"])[0][:300]


def _compile(cc: list[str], src: Path, dest: Path, flags: tuple[str, ...]) -> str | None:
    """Compile ``src`` to ``dest`` atomically; None on success, else a one-line reason."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.stem}-", suffix=".so.tmp", dir=dest.parent)
    os.close(fd)
    try:
        cmd = [*cc, *flags, "-o", tmp, str(src), *LIBS]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{shlex.join(cc)} failed to run: {e}"
        if proc.returncode != 0:
            return f"{shlex.join(cc)} failed: {_first_error_line(proc.stderr)}"
        os.replace(tmp, dest)
        return None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build(src: Path, cache_dir: Path) -> KernelLibrary:
    cc, why = find_compiler()
    if cc is None:
        return KernelLibrary(None, why)
    try:
        source = source_text(src)
        identity = _compiler_identity(cc)
    except (OSError, subprocess.SubprocessError) as e:
        return KernelLibrary(None, f"cannot use C compiler {shlex.join(cc)}: {e}")
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return KernelLibrary(None, f"kernel cache {cache_dir} is not writable: {e}")
    first_reason = None
    for extra in FLAG_VARIANTS:
        flags = (*BASE_FLAGS, *extra)
        dest = cache_dir / f"{src.stem}-{_cache_key(source, identity, flags)}.so"
        compiled = False
        if not dest.exists():
            log.info("compiling %s for this CPU (first use; cached in %s)", src.name, cache_dir)
            t0 = time.perf_counter()
            reason = _compile(cc, src, dest, flags)
            if reason is not None:
                first_reason = first_reason or reason
                continue
            compiled = True
            log.info("compiled %s in %.1f s -> %s", src.name, time.perf_counter() - t0, dest)
        try:
            lib = ctypes.CDLL(str(dest))
        except OSError as e:
            first_reason = first_reason or f"cannot load {dest}: {e}"
            continue
        missing = [f for f in FLAG_VARIANTS[0] if f not in extra]
        if missing:
            log.warning(
                "%s built without %s (%s): %s",
                src.name, " ".join(missing), first_reason,
                "it runs on one thread" if OPENMP_FLAG in missing else "generic vector code",
            )  # fmt: skip
        return KernelLibrary(lib, None, dest, extra, compiled)
    return KernelLibrary(None, first_reason)


def load_library(src: Path) -> KernelLibrary:
    """The compiled library of C source ``src`` (built and cached on first use, see the module
    docstring). Never raises for a build problem: the result's ``lib`` is then None and
    ``reason`` says why in one line."""
    fast = (str(src), *(os.environ.get(name, "") for name in _KEY_VARIABLES))
    found = _by_env.get(fast)
    if found is not None:
        return found
    cache_dir = env.kernel_cache_dir()
    key = (str(src), env.c_compiler() or "", str(cache_dir))
    with _lock:
        if key not in _loaded:
            _loaded[key] = _build(src, cache_dir)
        _by_env[fast] = _loaded[key]
        return _loaded[key]
