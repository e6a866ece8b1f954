"""The package map (README "Layout") holds: imports run one way between subpackages, torch is imported only inside
functions, and each subpackage says what it owns. The checker reads the source (ast), so a lazy import inside a
function counts as much as one at the top."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "kvgraft_cli"

# What each part may import (besides itself and the package root, which holds only __version__). The order is
# cli -> serve -> api -> library -> runs -> {engine, store, ledger, eval} -> artifacts -> config -> util -> errors,
# and audit (the torch-free verifier) reads ledger, artifacts and eval but never engine, runs or store.
BASE = {"errors"}
ALLOWED: dict[str, set[str]] = {"errors": set(), "util": BASE}
ALLOWED["config"] = ALLOWED["util"] | {"util"}
ALLOWED["artifacts"] = ALLOWED["config"] | {"config"}
for _peer in ("engine", "store", "ledger", "eval"):
    ALLOWED[_peer] = ALLOWED["artifacts"] | {"artifacts"}
ALLOWED["audit"] = ALLOWED["artifacts"] | {"artifacts", "ledger", "eval"}
ALLOWED["runs"] = ALLOWED["artifacts"] | {"artifacts", "engine", "store", "ledger", "eval"}
ALLOWED["library"] = ALLOWED["runs"] | {"runs"}
ALLOWED["report"] = ALLOWED["audit"] | {"audit"}  # the HTML report: reads what the verifier reads, and its verdict
# The public API (api.py): what a program imports, over the runs and the verifier; the CLI and the server call it
ALLOWED["api"] = ALLOWED["library"] | {"library", "audit"}
ALLOWED["serve"] = ALLOWED["api"] | {"api"}  # `kvgraft serve`: an api.Session behind an HTTP endpoint
ALLOWED["cli"] = ALLOWED["serve"] | {"serve", "report"}
ALLOWED["__main__"] = {"cli"}
HEAVY = ("torch", "transformers", "safetensors", "tokenizers", "boto3", "ray", "matplotlib")


def _part(module: str, known: set[str]) -> str:
    """kvgraft_cli.runs.graft -> runs; kvgraft_cli.errors -> errors; kvgraft_cli and kvgraft_cli.__version__ (a name
    in the root package, not a part) -> (root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in known else "(root)"


def _imports(path: Path, pkg_root: Path) -> list[tuple[int, str, bool]]:
    """(line, absolute module imported from kvgraft_cli, at module level?) for every import in a file."""
    rel = path.relative_to(pkg_root.parent).with_suffix("")
    me = list(rel.parts)
    if me[-1] == "__init__":
        me = me[:-1]
        package = me
    else:
        package = me[:-1]
    tree = ast.parse(path.read_text(), str(path))
    top = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            else:
                names = [node.module or ""]
            # `from . import x` may name a submodule: keep the most specific name that is one of ours.
            for name in names:
                found.append((node.lineno, name, id(node) in top))
        elif isinstance(node, ast.Import):
            for a in node.names:
                found.append((node.lineno, a.name, id(node) in top))
    return found


def violations(pkg_root: Path) -> list[str]:
    """Every import that runs against the map, and every module-level import of a heavy library."""
    bad = []
    known = {p.name for p in pkg_root.iterdir() if (p / "__init__.py").exists()} | {
        p.stem for p in pkg_root.glob("*.py")
    }
    for path in sorted(pkg_root.rglob("*.py")):
        rel = path.relative_to(pkg_root.parent).with_suffix("")
        me = ".".join(p for p in rel.parts if p != "__init__")
        here = _part(me, known)
        for line, target, at_top in _imports(path, pkg_root):
            where = f"{path.relative_to(pkg_root.parent)}:{line}"
            if target.split(".")[0] in HEAVY and at_top:
                bad.append(f"{where}: imports {target} at module level (import it inside the function)")
            if not target.startswith("kvgraft_cli"):
                continue
            there = _part(target, known)
            if there in (here, "(root)"):
                continue
            if there not in ALLOWED.get(here, set()):
                bad.append(f"{where}: {here} imports {target} ({there} is not below {here} in the map)")
    return bad


def circles(pkg_root: Path) -> list[str]:
    """Every pair of modules that import each other, at module level, inside a function or for annotations only
    (under ``if TYPE_CHECKING:``, which still ties the two together): "a <-> b", a before b."""
    modules = {
        ".".join(p for p in path.relative_to(pkg_root.parent).with_suffix("").parts if p != "__init__"): path
        for path in pkg_root.rglob("*.py")
    }
    edges: set[tuple[str, str]] = set()
    for me, path in modules.items():
        for _, target, _ in _imports(path, pkg_root):
            if not target.startswith("kvgraft_cli"):
                continue
            while target not in modules and "." in target:  # a name imported from a module -> that module
                target = target.rsplit(".", 1)[0]
            if target != me:
                edges.add((me, target))
    return sorted(f"{a} <-> {b}" for a, b in edges if a < b and (b, a) in edges)


def test_every_part_is_in_the_map():
    parts = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PKG.glob("*.py")}
    assert parts | (modules - {"__init__"}) == set(ALLOWED) - {"library"} | ({"library"} & parts)


def test_imports_run_one_way():
    assert violations(PKG) == []


def test_no_two_modules_import_each_other():
    assert circles(PKG) == []


@pytest.mark.parametrize(
    "where, line, needle",
    [
        (
            "artifacts/container.py",
            "def _z():\n    from .payload import CHUNK\n",
            "kvgraft_cli.artifacts.container <-> kvgraft_cli.artifacts.payload",
        ),
        (
            "runs/workers/ray.py",
            "def _w():\n    from ..deposit import deposit\n",
            "kvgraft_cli.runs.deposit <-> kvgraft_cli.runs.workers.ray",
        ),
    ],
)
def test_the_checker_sees_a_circle(tmp_path, where, line, needle):
    """The two circles this check was written after, put back in a copy of the package: each is named."""
    copy = tmp_path / "kvgraft_cli"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("data", "__pycache__"))
    target = copy / where
    target.write_text(target.read_text() + "\n" + line)
    assert circles(copy) == [needle]


def test_each_subpackage_says_what_it_owns():
    for init in PKG.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init} needs a docstring saying what the subpackage owns"


@pytest.mark.parametrize(
    "where, line, needle",
    [
        ("util/hashing.py", "from ..engine import engine\n", "util imports kvgraft_cli.engine"),
        ("audit/verify.py", "def _x():\n    from ..runs import graft\n", "audit imports kvgraft_cli.runs"),
        ("ledger/log.py", "from ..store import local\n", "ledger imports kvgraft_cli.store"),
        (
            "config/manifest.py",
            "def _y():\n    from ..engine.determinism import Drift\n",
            "config imports kvgraft_cli.engine",
        ),
        ("artifacts/format.py", "import torch\n", "imports torch at module level"),
    ],
)
def test_the_checker_sees_a_reverse_import(tmp_path, where, line, needle):
    """Break the map on purpose in a copy of the package: the checker must name the offending line."""
    copy = tmp_path / "kvgraft_cli"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("data", "__pycache__"))
    target = copy / where
    target.write_text(target.read_text() + "\n" + line)
    found = violations(copy)
    assert any(needle in v and where in v for v in found), found
