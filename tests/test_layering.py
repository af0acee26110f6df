"""Imports point down (DESIGN §1): a walk of every ``import`` with ``ast``, function bodies included.

Rules:

* ``pdserve/`` is the shared core: apart from the CLI (``pdserve/cli.py``, ``pdserve/commands/``)
  none of it imports ``router``, ``prefill_worker``, ``decode_worker`` or ``kv_transfer``.
* The router never imports torch, directly or through the project modules it imports (importing
  ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` too, so those count).
* Only the cluster module (``router/cluster``) and the worker actor modules (``actor*.py`` in
  ``prefill_worker/``, ``decode_worker/`` or ``pdserve/engine/``) import Ray.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pdserve", "router", "prefill_worker", "decode_worker", "kv_transfer")
UPPER_LAYERS = ("router", "prefill_worker", "decode_worker", "kv_transfer")
CLI_MODULES = ("pdserve.cli", "pdserve.commands")
RAY_ALLOWED_PACKAGES = ("prefill_worker", "decode_worker", "pdserve.engine")


def module_name(root: Path, path: Path) -> str:
    """Dotted module name of ``path`` (a package's ``__init__.py`` names the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path, module: str) -> Iterator[tuple[str, int]]:
    """Every module ``path`` may import, with its line: ``import a.b`` gives ``a.b``;
    ``from a import b`` gives ``a`` and ``a.b`` (b may be a submodule). Relative imports are
    resolved against ``module``. Imports inside functions and ``TYPE_CHECKING`` blocks count."""
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                drop = node.level - 1 if is_package else node.level
                base = base[: len(base) - drop] if drop else base
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield target, node.lineno
            for alias in node.names:
                if alias.name != "*":
                    yield f"{target}.{alias.name}", node.lineno


def under(name: str, prefixes: tuple[str, ...] | str) -> bool:
    """Whether ``name`` is one of ``prefixes`` or inside one of them."""
    if isinstance(prefixes, str):
        prefixes = (prefixes,)
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class ImportGraph:
    """Direct imports of every module in ``packages`` under ``root``."""

    def __init__(self, root: Path, packages: tuple[str, ...]) -> None:
        self.paths: dict[str, Path] = {}
        for pkg in packages:
            for path in sorted((root / pkg).rglob("*.py")):
                self.paths[module_name(root, path)] = path
        self.imports: dict[str, list[tuple[str, int]]] = {
            m: list(imported_names(p, m)) for m, p in self.paths.items()
        }

    def project_deps(self, module: str) -> set[str]:
        """Project modules that importing ``module`` runs first (parent packages included)."""
        deps: set[str] = set()
        for name, _ in self.imports[module]:
            parts = name.split(".")
            for k in range(1, len(parts) + 1):
                prefix = ".".join(parts[:k])
                if prefix in self.paths and prefix != module:
                    deps.add(prefix)
        return deps

    def chain_to(self, start: str, external: str) -> list[str] | None:
        """The shortest import chain from ``start`` to a module importing ``external``
        (``[start, ..., importer, external]``), or None."""
        seen = {start}
        frontier = [[start]]
        while frontier:
            nxt = []
            for chain in frontier:
                mod = chain[-1]
                if any(under(n, external) for n, _ in self.imports[mod]):
                    return [*chain, external]
                for dep in sorted(self.project_deps(mod)):
                    if dep not in seen:
                        seen.add(dep)
                        nxt.append([*chain, dep])
            frontier = nxt
        return None


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return ImportGraph(ROOT, PACKAGES)


def ray_allowed(module: str) -> bool:
    """The cluster module(s) and the worker actor modules."""
    if under(module, "router.cluster"):
        return True
    return under(module, RAY_ALLOWED_PACKAGES) and module.rsplit(".", 1)[-1].startswith("actor")


def test_the_walk_sees_the_project(graph: ImportGraph) -> None:
    for expected in ("pdserve.rpc", "router.serving", "router.cluster", "kv_transfer.base"):
        assert expected in graph.paths, f"{expected} not found under {ROOT}"


def test_core_does_not_import_upper_layers(graph: ImportGraph) -> None:
    bad = [
        f"{graph.paths[m].relative_to(ROOT)}:{line} imports {name}"
        for m in graph.paths
        if under(m, "pdserve") and not under(m, CLI_MODULES)
        for name, line in graph.imports[m]
        if under(name, UPPER_LAYERS)
    ]
    assert not bad, "pdserve/ must not import the layers above it:\n" + "\n".join(bad)


def test_router_never_imports_torch(graph: ImportGraph) -> None:
    bad = []
    for m in sorted(graph.paths):
        if under(m, "router"):
            chain = graph.chain_to(m, "torch")
            if chain is not None:
                bad.append(" -> ".join(chain))
    assert not bad, "router modules reach torch:\n" + "\n".join(bad)


def test_only_cluster_and_actors_import_ray(graph: ImportGraph) -> None:
    bad = [
        f"{graph.paths[m].relative_to(ROOT)}:{line} imports {name}"
        for m in graph.paths
        if not ray_allowed(m)
        for name, line in graph.imports[m]
        if under(name, "ray")
    ]
    assert not bad, "only router/cluster and the worker actors may import ray:\n" + "\n".join(bad)


def test_walk_finds_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The rules above are only as good as the walk: check it on a small fake tree."""
    pkg = tmp_path / "router"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from helper import tensors\n")
    helper = tmp_path / "helper"
    helper.mkdir()
    (helper / "__init__.py").write_text("")
    (helper / "tensors.py").write_text("import torch.nn\n")
    g = ImportGraph(tmp_path, ("router", "helper"))
    assert g.chain_to("router.a", "torch") == [
        "router.a",
        "router.b",
        "helper.tensors",
        "torch",
    ]
    assert g.chain_to("helper", "torch") is None


def test_router_loads_without_torch() -> None:
    """Importing every router module in a fresh interpreter leaves torch unloaded (this also
    catches a third-party import that pulls torch in)."""
    modules = sorted(
        module_name(ROOT, p) for p in (ROOT / "router").rglob("*.py") if p.name != "__main__.py"
    )
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False", "importing the router loaded torch"
