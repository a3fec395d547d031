"""Session-wide checks shared by every test directory."""

from __future__ import annotations

import gc
import importlib.machinery
import os

import pytest

_PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fastroute")
_DATAPLANE = os.path.join(_PACKAGE, "dataplane")
_CORE = os.path.join(_PACKAGE, "core")
_INTEGRATION = os.path.join(os.path.dirname(os.path.abspath(__file__)), "integration")


def stale_compiled_modules(directory: str = _DATAPLANE) -> list[str]:
    """Compiled modules of ``directory`` older than the .py or .pxd they were built from.

    The compiled module shadows its .py on import, so after an edit without a rebuild the
    tests would run yesterday's code while reading today's."""
    stale = []
    for name in sorted(os.listdir(directory)):
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            if name.endswith(suffix):
                stem = name[: -len(suffix)]
                built = os.path.getmtime(os.path.join(directory, name))
                for src in (stem + ".py", stem + ".pxd"):
                    path = os.path.join(directory, src)
                    if os.path.exists(path) and os.path.getmtime(path) > built:
                        stale.append(f"{name} (older than {src})")
                break
    return stale


def pytest_sessionstart(session: pytest.Session) -> None:
    stale = stale_compiled_modules() + stale_compiled_modules(_CORE)
    if stale:
        raise pytest.UsageError(
            "compiled modules are older than their sources: %s; rebuild with "
            "`python3 setup.py build_ext --inplace`" % ", ".join(stale)
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # pyproject's filterwarnings ignores ResourceWarning only for the integration tests' leaks; a
    # mark's filter takes precedence over the ini option, so a leak elsewhere fails its test.
    strict = pytest.mark.filterwarnings("error::ResourceWarning")
    for item in items:
        if not str(item.path).startswith(_INTEGRATION + os.sep):
            item.add_marker(strict)


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    # The last integration test before a strict one collects the integration tests' garbage in
    # its own teardown: a leak of theirs (see pytest_collection_modifyitems) found by a later
    # collector pass would otherwise fail whichever strict test happened to be running.
    here = str(item.path).startswith(_INTEGRATION + os.sep)
    if here and (nextitem is None or not str(nextitem.path).startswith(_INTEGRATION + os.sep)):
        gc.collect()
