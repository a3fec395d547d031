"""The compiled build of the data plane (and of the core's breakers, compiled the same way): which
classes become extension types, and the guard that keeps tests from running a compiled module
older than its source (tests/conftest.py)."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import os
import time

import pytest

from fastroute.compiled import built_extensions, py_modules
from tests.conftest import stale_compiled_modules

# The modules setup.py compiles from their .py: each .py with a .pxd beside it.
_ALL = py_modules()


def test_the_list_holds_the_hot_modules() -> None:
    names = {f"{p}.{m}" for p, m in _ALL}
    assert {
        "dataplane.protocol",
        "dataplane.endpoints",
        "dataplane.exchange",
        "dataplane.upstreams",
        "dataplane.pd",
        "dataplane.upstream",
        "core.breaker",
    } <= names
    assert not {"dataplane.app", "core._atomic", "core._policy"} & names


def test_every_listed_module_is_built_when_any_is() -> None:
    """setup.py builds the whole list: in a compiled tree no listed module is left interpreted
    (the interpreted test run deletes them all)."""
    built = [built_extensions(p, m) != [] for p, m in _ALL]
    assert all(built) or not any(built), dict(zip(_ALL, built))


@pytest.mark.parametrize("package, module", _ALL)
def test_declared_classes_are_extension_types_when_compiled(package: str, module: str) -> None:
    mod = importlib.import_module(f"fastroute.{package}.{module}")
    if mod.__file__.endswith(".py"):
        pytest.skip("running the interpreted data plane (no compiled build in place)")
    declared = _pxd_attributes(package, module)
    assert declared, f"{module}.pxd declares no class"
    for name in declared:
        cls = getattr(mod, name)
        # An extension type has no per-instance dict and refuses new attributes.
        obj = cls.__new__(cls)
        with pytest.raises(AttributeError):
            obj.not_declared_anywhere = 1


def _pxd_attributes(package: str, module: str) -> dict[str, set[str]]:
    """Attribute names each class of ``module``'s .pxd declares (``cdef [public|readonly] <type> a, b``)."""
    here = os.path.dirname(importlib.import_module(f"fastroute.{package}").__file__)
    out: dict[str, set[str]] = {}
    cls = None
    with open(os.path.join(here, f"{module}.pxd")) as f:
        lines = f.read().splitlines()
    for raw in lines:
        line = raw.strip()
        if line and not raw[0].isspace() and not line.startswith(("cdef class ", "#", "@")):
            cls = None  # a module-level declaration ends the class body
        if line.startswith("cdef class "):
            cls = line[len("cdef class ") :].split("(")[0].rstrip(":")
            out[cls] = set()
        elif cls is not None and line.startswith("cdef ") and not line.startswith("cdef class") and "(" not in line:
            # (a line with a parenthesis is a C method, not attributes)
            words = line.split(None, 3)  # cdef [public|readonly] <type> names...
            names = words[3] if words[1] in ("public", "readonly") else line.split(None, 2)[2]
            out[cls] |= {n.strip() for n in names.split(",")}
    return out


@pytest.mark.parametrize("package, module", _ALL)
def test_pxd_attributes_match_the_slots_of_the_interpreted_classes(package: str, module: str) -> None:
    """The .py's __slots__ (the interpreted build) and the .pxd (the compiled build) name the
    same attributes: a name missing from either fails only in that build."""
    declared = _pxd_attributes(package, module)
    here = os.path.dirname(importlib.import_module(f"fastroute.{package}").__file__)
    with open(os.path.join(here, f"{module}.py")) as f:
        source = f.read()
    tree = ast.parse(source)
    classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef)}
    assert set(declared) <= classes, (module, set(declared) - classes)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in declared:
            slots = [
                st for st in node.body if isinstance(st, ast.Assign) and getattr(st.targets[0], "id", "") == "__slots__"
            ]
            assert slots, f"{module}.{node.name} has no __slots__"
            names = set(ast.literal_eval(slots[0].value))
            assert names == declared[node.name], (module, node.name, names ^ declared[node.name])


def test_a_compiled_module_older_than_its_source_is_reported(tmp_path) -> None:
    ext = importlib.machinery.EXTENSION_SUFFIXES[0]
    old = time.time() - 100
    (tmp_path / f"fresh{ext}").write_bytes(b"")
    (tmp_path / "fresh.py").write_text("")
    os.utime(tmp_path / "fresh.py", (old, old))
    (tmp_path / f"stale{ext}").write_bytes(b"")
    os.utime(tmp_path / f"stale{ext}", (old, old))
    (tmp_path / "stale.py").write_text("")
    (tmp_path / "stale.pxd").write_text("")
    found = stale_compiled_modules(str(tmp_path))
    assert found == [f"stale{ext} (older than stale.py)", f"stale{ext} (older than stale.pxd)"]
