"""fastroute: a drop-in SGLang router that balances decode DP ranks by what each step waits for."""

from __future__ import annotations

__version__ = "0.1.0"
