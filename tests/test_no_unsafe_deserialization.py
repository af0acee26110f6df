"""No pickle, marshal or eval/exec of anything: the network reaches pdserve only as protobuf
(gRPC) and JSON (HTTP), and no code path turns bytes or text into objects or code otherwise.

The check scans the source of every package that serves requests. Ray (the control plane between
the router and its workers, a trusted cluster network) pickles its own calls; pdserve never does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdserve", "router", "prefill_worker", "decode_worker", "kv_transfer")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} imports {a.name}" for a in node.names if a.name in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module in UNSAFE_MODULES:
            found.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Name) and f.id in UNSAFE_BUILTINS:
                found.append(f"{where} calls {f.id}()")
            if isinstance(f, ast.Attribute) and f.attr == "load":
                # torch.load unpickles unless weights_only=True; yaml.load runs constructors
                base = f.value.id if isinstance(f.value, ast.Name) else ""
                safe = any(
                    k.arg == "weights_only"
                    and isinstance(k.value, ast.Constant)
                    and k.value.value is True
                    for k in node.keywords
                )
                if base in ("torch", "yaml") and not safe:
                    found.append(f"{where} calls {base}.load() without weights_only=True")
    return found


def test_no_pickle_marshal_or_eval_in_serving_code() -> None:
    files = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50  # the scan really saw the packages
    violations = [v for p in files for v in _violations(p)]
    assert not violations, "\n".join(violations)


def test_the_scan_catches_what_it_forbids(tmp_path: Path) -> None:
    bad = ROOT / "router" / "_scan_probe_never_committed.py"
    src = "import pickle\nfrom marshal import loads\neval('1')\nimport torch\ntorch.load('x')\n"
    bad.write_text(src)
    try:
        assert len(_violations(bad)) == 4
    finally:
        bad.unlink()
