"""KV-event benchmark (thin wrapper): ``python bench/kv_events.py [--rates 4 6] [--decodes 1]``.

The Mooncake conversation trace through the router with and without the engines' KV events,
against least_requests, SGLang's own total_tokens balancing and an oracle that knows every
rank's cache. Everything lives in fastroute.sim.kvbench; this file only makes the benchmark
runnable from a checkout without installing the package.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fastroute.sim.kvbench import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
