"""Measure the data plane compiled *as it is* with Cython against the same code interpreted.

Does compiling the data-plane modules pay? This script answers the first half
of that question with one run: it exports HEAD (``git archive``) into a scratch directory, builds
the core extensions there as usual, then also compiles every ``fastroute/dataplane/*.py`` with
Cython unchanged (plain Python classes, no ``cdef class``, no typed attributes; the ``.so`` next to
each ``.py`` shadows it), and runs ``bench/overhead.py`` from this checkout (interpreted, as
``fastroute``) with the scratch copy as ``--base-checkout`` (compiled, as ``fastroute-base``).
In the report, ``fastroute/base`` above 1 for req/s means the interpreted code is faster.

Usage: ``python bench/compile_plain.py [--rounds 3] [--duration 3] [--keep]``
(the extensions of this checkout must be built in place; needs nginx and wrk like overhead.py).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# The build of the scratch copy: the project's own setup.py for the core, then this for the
# data plane (Cython's defaults for plain Python code; annotations are not used as C types).
_DATAPLANE_SETUP = """
from pathlib import Path
from Cython.Build import cythonize
from setuptools import Extension, setup
mods = sorted(p.stem for p in Path("fastroute/dataplane").glob("*.py") if p.stem != "__init__")
exts = [Extension(f"fastroute.dataplane.{m}", [f"fastroute/dataplane/{m}.py"],
                  extra_compile_args=["-O3"]) for m in mods]
setup(ext_modules=cythonize(exts, compiler_directives={"language_level": 3,
                                                       "annotation_typing": False},
                            build_dir="build/cython-dataplane"))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy (path printed)")
    a = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="fastroute-compiled-"))
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "HEAD"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(scratch)], input=archive, check=True)
        build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", "2"]
        subprocess.run(build, cwd=scratch, check=True, capture_output=True)
        (scratch / "setup_dataplane.py").write_text(_DATAPLANE_SETUP)
        subprocess.run([sys.executable, "setup_dataplane.py", *build[2:]], cwd=scratch, check=True, capture_output=True)
        built = sorted(p.name for p in (scratch / "fastroute" / "dataplane").glob("*.so"))
        print(f"compiled data plane in {scratch}: {len(built)} modules", flush=True)
        out = HERE / "out" / "compile_plain.md"
        return subprocess.run(
            [
                sys.executable,
                str(HERE / "overhead.py"),
                "--skip-peers",
                "--modes",
                "regular",
                "--rounds",
                str(a.rounds),
                "--duration",
                str(a.duration),
                "--latency-requests",
                "600",
                "--base-checkout",
                str(scratch),
                "--out",
                str(out),
            ],
            cwd=REPO,
        ).returncode
    finally:
        if a.keep:
            print(f"scratch copy kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
