"""The .pyi stubs beside the compiled modules list exactly their Python-visible API, so the
``py.typed`` marker the package ships is honest.  Also: every .pyx has its .pyi."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

import fastroute.names
from fastroute.core import _ledger, _policy, _tree

CORE = Path(_ledger.__file__).parent


def stub_api(module) -> tuple[set[str], dict[str, set[str]]]:
    tree = ast.parse((CORE / f"{module.__name__.rsplit('.', 1)[1]}.pyi").read_text())
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
    # Names a module imports from fastroute.names are not its API (ints are interned: skip them).
    shared = {id(v) for v in vars(fastroute.names).values() if not isinstance(v, int)}
    return {
        n
        for n, v in vars(module).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType) and id(v) not in shared
    }


def public(cls) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


@pytest.mark.parametrize("module", [_ledger, _policy, _tree], ids=lambda m: m.__name__)
def test_stub_lists_the_runtime_api(module):
    top, members = stub_api(module)
    assert top == runtime_api(module)
    for name, names in members.items():
        cls = getattr(module, name)
        if issubclass(cls, Exception):
            continue
        assert {n for n in names if not n.startswith("_")} == public(cls), name


def test_every_pyx_has_a_pyi():
    assert {p.stem for p in CORE.glob("*.pyx")} == {p.stem for p in CORE.glob("*.pyi")}
