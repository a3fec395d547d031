"""Which modules setup.py compiles, derived from the tree so that adding one is a single edit:

* every ``fastroute/<package>/<name>.pyx`` (the core's kernels), and
* every ``fastroute/<package>/<name>.py`` with a ``<name>.pxd`` beside it: the data plane's hot
  classes and the core's breakers, compiled from the .py in Cython's pure-Python mode (the .pxd
  says which classes become extension types and the C types of their attributes).

A .pxd with neither beside it (``core/_atomic.pxd``, ``_layout.pxd``, ...) only declares C
helpers for ``cimport``. This module imports nothing from fastroute: setup.py loads it by path
before anything is built, and the tests read the same lists.

``python -m fastroute.compiled --interpreted`` deletes the built extension of every module of the
second kind, so the next import runs its .py: the interpreted data plane, which ``.ci/run`` tests
before it rebuilds.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _packages(root: str) -> list[str]:
    base = os.path.join(root, "fastroute")
    return sorted(d for d in os.listdir(base) if os.path.isfile(os.path.join(base, d, "__init__.py")))


def _stems(root: str, package: str, suffix: str) -> set[str]:
    here = os.path.join(root, "fastroute", package)
    return {f[: -len(suffix)] for f in os.listdir(here) if f.endswith(suffix)}


def pyx_modules(root: str = ROOT) -> list[tuple[str, str]]:
    """(package, module) of every .pyx, e.g. ("core", "_policy")."""
    return [(p, m) for p in _packages(root) for m in sorted(_stems(root, p, ".pyx"))]


def py_modules(root: str = ROOT) -> list[tuple[str, str]]:
    """(package, module) of every .py compiled through the .pxd beside it."""
    return [(p, m) for p in _packages(root) for m in sorted(_stems(root, p, ".pxd") & _stems(root, p, ".py"))]


def built_extensions(package: str, module: str, root: str = ROOT) -> list[str]:
    """Paths of the extension files built in place for ``fastroute.<package>.<module>``."""
    here = os.path.join(root, "fastroute", package)
    return [
        os.path.join(here, module + s)
        for s in importlib.machinery.EXTENSION_SUFFIXES
        if os.path.exists(os.path.join(here, module + s))
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="The modules setup.py compiles.")
    ap.add_argument(
        "--interpreted", action="store_true", help="delete the built extensions of the modules compiled from their .py"
    )
    a = ap.parse_args(argv)
    if a.interpreted:
        for package, module in py_modules():
            for path in built_extensions(package, module):
                os.remove(path)
                print(f"removed {os.path.relpath(path, ROOT)}")
        return 0
    for package, module in pyx_modules():
        print(f"fastroute/{package}/{module}.pyx")
    for package, module in py_modules():
        print(f"fastroute/{package}/{module}.py")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
