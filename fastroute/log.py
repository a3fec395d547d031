"""Logging set-up of every fastroute process (the CLI's and each proxy process's).

Root logging: timestamp, level, pid and logger name, on stderr and optionally in
``DIR/fastroute.log``. Logger names are per module and stable ("fastroute.proxy",
"fastroute.workers", ...), so operators can filter on them.
"""
from __future__ import annotations

import logging
import os
import sys

__all__ = ["configure_logging"]

_LOG_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
_HANDLER_TAG = "_fastroute_handler"


def configure_logging(level: str = "info", log_dir: str | None = None) -> None:
    """Root logging: timestamp, level, pid and logger name on stderr (and DIR/fastroute.log).

    Replaces only handlers this function installed earlier, so a host application's (or
    pytest's) own handlers survive.
    """
    name = "warning" if level.lower() == "warn" else level.lower()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_TAG, False):
            root.removeHandler(handler)
            handler.close()
    formatter = logging.Formatter(_LOG_FORMAT)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        handlers.append(logging.FileHandler(os.path.join(log_dir, "fastroute.log")))
    for handler in handlers:
        setattr(handler, _HANDLER_TAG, True)
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(getattr(logging, name.upper()))
