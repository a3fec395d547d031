"""Speed-aware placement on mixed hardware: 1 prefill + 2 decode servers (DP 8), the second
1.0 / 1.6 / 2.5 times slower or slowing down mid-run, the conversation workload with 30% of the
requests carrying a TPOT target; least_requests, demand and --speed-aware on compared. Everything
lives in fastroute.sim.speedbench; this file only makes the benchmark runnable from a checkout
without installing the package.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastroute.sim.speedbench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
