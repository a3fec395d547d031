"""`python -m fastroute ARGS`: same as the `fastroute` console script."""

from __future__ import annotations

from fastroute.config.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
