"""Build of fastroute's compiled modules.

Compiler directives are set once here for every module.  FASTROUTE_DEBUG=1 builds with bounds
checks and C asserts on, for chasing a memory bug.
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("FASTROUTE_DEBUG") == "1"

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "cdivision": True,
    "initializedcheck": DEBUG,
    "embedsignature": True,
}
cflags = ["-O0", "-g"] if DEBUG else ["-O3"]
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if not DEBUG:
    macros.append(("NDEBUG", "1"))


def ext(name):
    return Extension(
        f"fastroute.core.{name}",
        [f"fastroute/core/{name}.pyx"],
        include_dirs=["csrc", np.get_include()],
        define_macros=macros,
        extra_compile_args=cflags,
    )


setup(
    ext_modules=cythonize(
        [ext("_policy"), ext("_ledger"), ext("_tree")],
        compiler_directives=directives,
        include_path=["."],
    ),
)
