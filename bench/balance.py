"""Decode DP-rank balance benchmark (thin wrapper): ``python bench/balance.py [--sweep] [--concurrency 64 192]``,
``python bench/balance.py --conversations [--kv-tight]`` for the prefix-sharing trace,
``python bench/balance.py --engine-balance`` for SGLang's own rank balancing against fastroute's
(1P1D / 1P2D, DP-8 prefill, C = 192 and 512).
``python bench/balance.py --gateway`` for the same placement through Envoy + ``fastroute epp``.

Everything lives in fastroute.sim.balance; this file only makes the benchmark runnable from a
checkout without installing the package.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastroute.sim import convbench, enginebench  # noqa: E402
from fastroute.sim.balance import main  # noqa: E402

if __name__ == "__main__":
    if "--conversations" in sys.argv[1:]:
        # prefix-sharing conversations replayed open loop (fastroute.sim.convbench)
        raise SystemExit(convbench.main([a for a in sys.argv[1:] if a != "--conversations"]))
    if "--engine-balance" in sys.argv[1:]:
        # SGLang's --load-balance-method (no router rank) vs fastroute (fastroute.sim.enginebench)
        raise SystemExit(enginebench.main([a for a in sys.argv[1:] if a != "--engine-balance"]))
    raise SystemExit(main())
