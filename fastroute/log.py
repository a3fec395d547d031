"""Logging set-up of every fastroute process (the CLI's and each proxy process's).

Root logging: timestamp, level, pid and logger name, on stderr and optionally in
``DIR/fastroute.log``; or, with ``--log-json``, one JSON object per line (what Kubernetes log
pipelines parse). Logger names are per module and stable ("fastroute.proxy",
"fastroute.workers", ...), so operators can filter on them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone

__all__ = ["configure_logging", "JsonFormatter", "startup_error"]

_LOG_FORMAT = "%(asctime)s %(levelname)s [%(process)d] %(name)s: %(message)s"
_HANDLER_TAG = "_fastroute_handler"
# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, pid, the ``extra`` fields and,
    for an exception, its traceback as one string."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in doc:
                doc[key] = value
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, ensure_ascii=False)


def configure_logging(level: str = "info", log_dir: str | None = None, json_lines: bool = False) -> None:
    """Root logging on stderr (and DIR/fastroute.log): text lines, or JSON with ``json_lines``.

    Replaces only handlers this function installed earlier, so a host application's (or
    pytest's) own handlers survive.
    """
    name = "warning" if level.lower() == "warn" else level.lower()
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_TAG, False):
            root.removeHandler(handler)
            handler.close()
    formatter = JsonFormatter() if json_lines else logging.Formatter(_LOG_FORMAT)
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
        handlers.append(logging.FileHandler(os.path.join(log_dir, "fastroute.log")))
    for handler in handlers:
        setattr(handler, _HANDLER_TAG, True)
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(getattr(logging, name.upper()))


def startup_error(message: str, json_lines: bool = False) -> None:
    """A refusal to start, as one line on stderr: ``fastroute: error: MESSAGE``, or with
    ``--log-json`` one JSON object (level ERROR, logger ``fastroute.startup``, ``event``
    ``startup_error``) like every other line. Line breaks in the message become spaces."""
    text = " ".join(str(message).split())
    if json_lines:
        record = logging.LogRecord("fastroute.startup", logging.ERROR, __file__, 0, text, None, None)
        record.event = "startup_error"
        line = JsonFormatter().format(record)
    else:
        line = f"fastroute: error: {text}"
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
