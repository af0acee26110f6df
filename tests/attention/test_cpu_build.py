"""Building C kernels on first use: the cache (one compile, then loads), its key, and every way a
build can fail turning into a one-line reason instead of an exception."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import env
from pdserve.attention import cpu_build
from pdserve.attention.cpu_build import find_compiler, load_library, source_text

pytestmark = pytest.mark.timeout(120)

SOURCE = """
int pd_answer(void) { return ANSWER; }
int pd_threads(void) {
    int n = 0;
#pragma omp parallel num_threads(2)
    {
#pragma omp atomic
        n++;
    }
    return n;
}
"""


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kernel cache directory (PDSERVE_KERNEL_CACHE) and the default compiler."""
    monkeypatch.setenv(env.KERNEL_CACHE, str(tmp_path / "cache"))
    monkeypatch.delenv(env.CC, raising=False)
    return tmp_path / "cache"


def _source(tmp_path: Path, answer: int = 42, name: str = "tiny.c") -> Path:
    src = tmp_path / name
    src.write_text(SOURCE.replace("ANSWER", str(answer)))
    return src


def test_compiles_once_then_every_process_loads_the_cached_library(
    tmp_path: Path, cache: Path
) -> None:
    src = _source(tmp_path)
    kl = load_library(src)
    assert kl.lib is not None, kl.reason
    assert kl.compiled and kl.openmp and kl.path is not None and kl.path.parent == cache
    assert kl.lib.pd_answer() == 42 and kl.lib.pd_threads() == 2
    assert sorted(p.name for p in cache.iterdir()) == [kl.path.name]  # no temporary left over
    assert load_library(src) is kl  # memoised in this process
    mtime = kl.path.stat().st_mtime_ns

    # another process finds it in the cache: no compile, same file
    code = (
        "import sys; from pathlib import Path; from pdserve.attention.cpu_build import "
        "load_library; kl = load_library(Path(sys.argv[1])); "
        "print(kl.compiled, kl.path, kl.lib.pd_answer())"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(src)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", str(kl.path), "42"]
    assert kl.path.stat().st_mtime_ns == mtime


def test_a_changed_source_gets_its_own_library(tmp_path: Path, cache: Path) -> None:
    first = load_library(_source(tmp_path, 1, "a.c"))
    second = load_library(_source(tmp_path, 2, "b.c"))
    assert first.lib is not None and second.lib is not None
    assert first.path != second.path and second.compiled
    assert (first.lib.pd_answer(), second.lib.pd_answer()) == (1, 2)


def test_missing_compiler_is_a_reason(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env.CC, "/nonexistent/cc")
    kl = load_library(_source(tmp_path))
    assert kl.lib is None and kl.reason == "C compiler CC='/nonexistent/cc' not found"
    monkeypatch.setenv("PATH", str(tmp_path))  # neither cc nor gcc on PATH
    monkeypatch.delenv(env.CC)
    assert find_compiler() == (None, "no C compiler (cc or gcc) on PATH; set CC")
    assert not cache.exists() or not any(cache.iterdir())


def test_compile_error_is_one_line(tmp_path: Path, cache: Path) -> None:
    src = tmp_path / "broken.c"
    src.write_text("int pd_answer(void) { return }\n")
    kl = load_library(src)
    assert kl.lib is None and kl.reason is not None
    assert "failed" in kl.reason and "error" in kl.reason and "\n" not in kl.reason
    assert not any(cache.iterdir())  # the failed output was removed


def test_unwritable_cache_is_a_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(env.KERNEL_CACHE, str(blocker / "kernels"))
    kl = load_library(_source(tmp_path))
    assert kl.lib is None and kl.reason is not None and "is not writable" in kl.reason


@pytest.mark.parametrize(
    ("rejected", "flags", "threads", "warning"),
    [
        ("-fopenmp", ("-march=native",), 1, "it runs on one thread"),
        ("-march=native", ("-fopenmp",), 2, "generic vector code"),
    ],
)
def test_a_flag_the_compiler_rejects_is_left_out(
    tmp_path: Path,
    cache: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    rejected: str,
    flags: tuple[str, ...],
    threads: int,
    warning: str,
) -> None:
    """A compiler without OpenMP (e.g. Apple clang) or without -march=native: the next build."""
    real, why = find_compiler()
    assert real is not None, why
    fake = tmp_path / "cc-limited"
    fake.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do [ "$a" = {rejected} ] && {{ echo "error: unsupported {rejected}" >&2; '
        "exit 1; }; done\n"
        f'exec {real[0]} "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv(env.CC, str(fake))
    kl = load_library(_source(tmp_path))
    assert kl.lib is not None and kl.flags == flags and kl.openmp == (threads == 2)
    assert kl.lib.pd_threads() == threads  # without OpenMP the pragma is ignored
    assert f"built without {rejected}" in caplog.text and f"unsupported {rejected}" in caplog.text
    assert warning in caplog.text


def test_default_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(env.KERNEL_CACHE, raising=False)
    monkeypatch.setenv(env.XDG_CACHE_HOME, str(tmp_path))
    assert env.kernel_cache_dir() == tmp_path / "pdserve" / "kernels"
    monkeypatch.delenv(env.XDG_CACHE_HOME)
    assert env.kernel_cache_dir() == Path.home() / ".cache" / "pdserve" / "kernels"


def test_an_included_header_is_part_of_the_cache_key(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel that includes a header by ``#include "..."`` is rebuilt when the header changes
    (a cached binary of the old header is not handed out)."""
    (tmp_path / "sub").mkdir()
    header = tmp_path / "sub" / "answer.h"
    header.write_text("#define ANSWER 7\n")
    src = tmp_path / "with_header.c"
    src.write_text('#include "sub/answer.h"\nint pd_answer(void) { return ANSWER; }\n')
    first = source_text(src)
    assert b"#define ANSWER 7" in first
    kl = load_library(src)
    assert kl.lib is not None and kl.lib.pd_answer() == 7, kl.reason
    header.write_text("#define ANSWER 8\n")
    assert source_text(src) != first
    # as a new process: nothing memoised
    monkeypatch.setattr(cpu_build, "_loaded", {})
    monkeypatch.setattr(cpu_build, "_by_env", {})
    again = load_library(src)
    assert again.lib is not None and again.compiled and again.lib.pd_answer() == 8
