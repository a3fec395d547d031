"""The .pyi stubs beside the compiled modules list exactly their Python-visible API, so the
``py.typed`` marker the package ships is honest.  Also: every .pyx has its .pyi, each of the
nine compiled modules is checked, and the wheel ships every package's stubs (package-data)."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import types
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import load_file

import fastroute.config
import fastroute.names

ROOT = Path(fastroute.names.__file__).parent.parent
PACKAGE = ROOT / "fastroute"
# Every Cython source in the package, as a module name: fastroute.core._ledger, ...
PYX = sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in PACKAGE.rglob("*.pyx"))


def stub_path(module) -> Path:
    return Path(module.__file__).parent / f"{module.__name__.rsplit('.', 1)[1]}.pyi"


def stub_api(module) -> tuple[set[str], dict[str, set[str]]]:
    tree = ast.parse(stub_path(module).read_text())
    top: set[str] = set()
    members: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            members[node.name] = {
                n.name if isinstance(n, ast.FunctionDef) else n.target.id
                for n in node.body
                if isinstance(n, ast.FunctionDef) or (isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
            }
    return {n for n in top if not n.startswith("_")}, members


def runtime_api(module) -> set[str]:
    # Names a module imports from fastroute.names or fastroute.config are not its API (ints are
    # interned: skip them).
    shared = {
        id(v) for source in (fastroute.names, fastroute.config) for v in vars(source).values() if not isinstance(v, int)
    }
    return {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and id(v) not in shared
    }


def public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_all_nine_compiled_modules_are_checked():
    # Four kernels in core, five request-path helpers in the data plane (issue 49).
    assert len(PYX) == 9, PYX


@pytest.mark.parametrize("name", PYX)
def test_stub_lists_the_runtime_api(name):
    module = importlib.import_module(name)
    assert not module.__file__.endswith(".py"), f"{name} is not compiled: build it (setup.py build_ext --inplace)"
    top, members = stub_api(module)
    assert top == runtime_api(module)
    for name, names in members.items():
        cls = getattr(module, name)
        if issubclass(cls, Exception):
            continue
        assert {n for n in names if not n.startswith("_")} == public(cls), name


def test_every_pyx_has_a_pyi():
    pyx = {p.with_suffix("") for p in PACKAGE.rglob("*.pyx")}
    pyi = {p.with_suffix("") for p in PACKAGE.rglob("*.pyi")}
    assert pyx == pyi


def test_the_wheel_ships_every_stub():
    # setuptools installs a package's non-.py files only when package-data names them: a stub
    # left out would make the installed py.typed marker claim types the wheel does not have.
    pyproject = load_file(ROOT / "pyproject.toml")  # setuptools' own reader (tomllib is 3.11+)
    package_data = pyproject["tool"]["setuptools"]["package-data"]
    for stub in PACKAGE.rglob("*.pyi"):
        package = ".".join(stub.parent.relative_to(ROOT).parts)
        patterns = package_data.get(package, [])
        assert any(fnmatch.fnmatch(stub.name, pat) for pat in patterns), f"{package} package-data misses {stub.name}"
    assert "py.typed" in package_data["fastroute"]
