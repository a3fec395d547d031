"""Router replicas benchmark (thin wrapper): ``python bench/replicas.py [--replicas 2 3 4] [--arrivals bursty smooth]``.

Everything lives in fastroute.sim.convbench; this file only makes the benchmark runnable from a
checkout without installing the package.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastroute.sim.convbench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(mode="replicas"))
