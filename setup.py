"""Build of fastroute's compiled modules.

Compiler directives are set once here for every module.  Two switches, by environment variable
(read at build time; pass ``--force`` to build_ext when switching, since the C compile step does
not see them change; the generated C is kept apart per directive set, under build/):

* ``FASTROUTE_DEBUG=1``: Cython bounds, wraparound and initialization checks on, C built with
  ``-O0 -g``.  The kernels then raise (or report) an out-of-range index instead of reading past
  a table; ``.ci/run`` runs the unit tests on this build before the release build.
* ``FASTROUTE_SANITIZE=1``: also compile and link with ``-fsanitize=address,undefined`` (ASan and
  UBSan), for chasing a memory bug.  CPython itself is not instrumented, so the ASan runtime must
  be loaded first, e.g.::

      FASTROUTE_SANITIZE=1 python3 setup.py build_ext --inplace --force
      LD_PRELOAD=$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0 \\
          python3 -m pytest -q tests/unit

  (``detect_leaks=0``: the interpreter's own allocations at exit are not ours.)

Release builds (neither switch) use ``-O3`` and no checks: every Python entry point validates
its indices itself, and the nogil inner loops run unchecked.
"""

import importlib.util
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

# The module lists, derived from the tree (fastroute/compiled.py), loaded by path: the package
# itself cannot be imported before it is built.
_spec = importlib.util.spec_from_file_location(
    "fastroute_compiled", os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastroute", "compiled.py")
)
compiled = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compiled)

DEBUG = os.environ.get("FASTROUTE_DEBUG") == "1"
SANITIZE = os.environ.get("FASTROUTE_SANITIZE") == "1"

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "cdivision": True,
    "initializedcheck": DEBUG,
    "embedsignature": True,
}
cflags = ["-O0", "-g"] if DEBUG else ["-O3"]
ldflags = []
if SANITIZE:
    sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"]
    cflags += sanitize + ([] if DEBUG else ["-g"])
    ldflags += sanitize
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if not DEBUG:
    # Silences CPython's and NumPy's C asserts in release builds (fastroute's C has none).
    macros.append(("NDEBUG", "1"))


def ext(package, name):
    return Extension(
        f"fastroute.{package}.{name}",
        [f"fastroute/{package}/{name}.pyx"],
        include_dirs=["csrc", np.get_include()],
        define_macros=macros,
        extra_compile_args=cflags,
        extra_link_args=ldflags,
    )


# The data plane's hot classes and the core's breakers, compiled from their .py (Cython
# pure-Python mode): each module's .pxd declares which classes become extension types and the C
# types of their attributes; the .py stays the one source (and runs as it is wherever it is not
# compiled). Annotations stay documentation (annotation_typing off): only the .pxd declares C
# types.


def py_ext(package, name):
    return Extension(
        f"fastroute.{package}.{name}",
        [f"fastroute/{package}/{name}.py"],
        define_macros=[m for m in macros if m[0] == "NDEBUG"],
        extra_compile_args=cflags,
        extra_link_args=ldflags,
    )


# One C output directory per directive set: Cython regenerates C only when a source or .pxd is
# newer than it, so a debug build must not reuse the release C (or the reverse).
build_dir = "build/cython-debug" if DEBUG else "build/cython-release"
setup(
    ext_modules=cythonize(
        [ext(package, name) for package, name in compiled.pyx_modules()],
        compiler_directives=directives,
        include_path=["."],
        build_dir=build_dir,
    )
    + cythonize(
        [py_ext(package, name) for package, name in compiled.py_modules()],
        compiler_directives={**directives, "annotation_typing": False},
        include_path=["."],
        build_dir=build_dir,
    ),
)
