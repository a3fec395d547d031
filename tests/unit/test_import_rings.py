"""The data plane's import rule, checked per module: importing any module of
``fastroute.dataplane`` in a fresh interpreter loads neither NumPy, nor any
``fastroute.core`` module, nor any compiled fastroute extension other than the data plane's
own modules (compiled from their .py, see setup.py). (The breakers, reconciler and routing
groups it uses are handed in by the runtime.)

And the router as a whole (``fastroute.config.cli``, which imports every ring) loads no optional
dependency of a flag that is off by default: redis (``--replica-sync``), kubernetes_asyncio and
aiohttp (``--service-discovery``) are imported where those flags start their parts, and grpc
and Envoy's protos only by ``fastroute epp``."""

from __future__ import annotations

import os
import pkgutil
import subprocess
import sys

import pytest

import fastroute
import fastroute.dataplane

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(fastroute.__file__)))
_MODULES = sorted(m.name for m in pkgutil.iter_modules(fastroute.dataplane.__path__, "fastroute.dataplane."))

# Run in the child: import one module, print every forbidden module it pulled in.
_PROBE = """
import importlib, importlib.machinery, sys
importlib.import_module(sys.argv[1])
ext = tuple(importlib.machinery.EXTENSION_SUFFIXES)
bad = []
for name, mod in sorted(sys.modules.items()):
    path = getattr(mod, "__file__", None) or ""
    if (name == "numpy" or name.startswith("numpy.")
            or name == "fastroute.core" or name.startswith("fastroute.core.")
            or (name.startswith("fastroute") and not name.startswith("fastroute.dataplane.")
                and path.endswith(ext))):
        bad.append(name)
print(" ".join(bad))
"""


def test_every_data_plane_module_is_checked() -> None:
    assert {
        "fastroute.dataplane.app",
        "fastroute.dataplane.protocol",
        "fastroute.dataplane.exchange",
        "fastroute.dataplane.pd",
        "fastroute.dataplane.flow",
        "fastroute.dataplane.route",
    } <= set(_MODULES)


@pytest.mark.parametrize("module", _MODULES)
def test_data_plane_module_imports_no_numpy_and_no_core(module: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, module], env=env, cwd=_ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [], f"{module} loads {out.stdout.strip()}"


_OPTIONAL = ("redis", "kubernetes_asyncio", "aiohttp", "grpc", "grpc_health", "envoy")
_PROBE_OPTIONAL = """
import sys
import fastroute.config.cli
print(" ".join(sorted({n.partition(".")[0] for n in sys.modules} & set(sys.argv[1:]))))
"""


def test_router_imports_no_optional_dependency_of_a_flag_left_off() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    out = subprocess.run(
        [sys.executable, "-c", _PROBE_OPTIONAL, *_OPTIONAL],
        env=env,
        cwd=_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [], f"importing fastroute.config.cli loads {out.stdout.strip()}"
