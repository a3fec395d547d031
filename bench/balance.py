"""Decode DP-rank balance benchmark (thin wrapper): ``python bench/balance.py [--sweep] [--concurrency 64 192]``.

Everything lives in fastroute.sim.balance; this file only makes the benchmark runnable from a
checkout without installing the package.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastroute.sim.balance import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
