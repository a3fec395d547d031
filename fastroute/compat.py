"""``sglang_router`` imports answered by fastroute, for launchers whose import line cannot change.

RL launchers (slime, miles) and SGLang's own scripts say ``from sglang_router.launch_router
import RouterArgs, launch_router``. After :func:`install`, that import (and
``sglang_router.router_args``) gives :mod:`fastroute.launch_router`'s ``RouterArgs`` and
``launch_router``, in this process and in the processes it forks. Two ways in, without editing
the launcher:

    python -m fastroute.compat -m slime.train ARGS...     # a module, as `python -m` would
    python -m fastroute.compat launcher.py ARGS...        # a script

or, for every Python process of an environment (also ``spawn``-started ones), a
``sitecustomize.py`` on its path containing ``import fastroute.compat; fastroute.compat.install()``.

The real ``sglang_router`` is never imported; if it already was, :func:`install` refuses
(mixing the two would start the wrong router).
"""

from __future__ import annotations

import runpy
import sys
import types
from collections.abc import Sequence

from fastroute import __version__

# The module names sglang-router 0.3.2 launchers import RouterArgs / launch_router from.
ALIASES = ("sglang_router.launch_router", "sglang_router.router_args")


def install() -> None:
    """Make ``sglang_router`` (and the ALIASES) name fastroute's launch module. Idempotent."""
    from fastroute import launch_router as target

    pkg = sys.modules.get("sglang_router")
    if pkg is not None and not getattr(pkg, "__fastroute__", False):
        raise RuntimeError(
            "sglang_router was imported before fastroute.compat.install(); call "
            "install() first (or use python -m fastroute.compat)"
        )
    if pkg is None:
        pkg = types.ModuleType("sglang_router", "fastroute standing in for sglang-router")
        pkg.__path__ = []  # a package: its submodules come from sys.modules
        pkg.__fastroute__ = True  # type: ignore[attr-defined]
        pkg.__version__ = __version__  # type: ignore[attr-defined]
        sys.modules["sglang_router"] = pkg
    for name in ALIASES:
        sys.modules[name] = target
        setattr(pkg, name.rsplit(".", 1)[1], target)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastroute.compat (-m MODULE | SCRIPT) ARGS...``: install, then run it."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        sys.stderr.write("usage: python -m fastroute.compat (-m MODULE | SCRIPT) [ARGS...]\n")
        return 2
    install()
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        runpy.run_path(args[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
