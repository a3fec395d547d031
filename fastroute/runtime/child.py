"""One proxy process of ``--workers N``: ``python -P -m fastroute.runtime.child STATE_DIR SLOT``.

Started (and restarted) by :mod:`fastroute.runtime.supervisor`, which leaves in its private state
directory the pickled Config and ``child.json`` (shared-memory names, the port, the control
listener's URL and secret). The process attaches the shared table and its own ledger, mirrors
the supervisor's workers (:class:`~fastroute.control.follower.FollowerRegistry`), listens on the
shared port with ``SO_REUSEPORT`` and serves requests until SIGTERM, then drains.

Every ``STATS_INTERVAL`` seconds, and when it exits, it pickles its Stats into
``stats-SLOT.pickle`` for the supervisor's ``/metrics``.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import pickle
import signal
import sys

import uvloop

from fastroute.config import Config
from fastroute.control.follower import SYNC_INTERVAL, FollowerRegistry
from fastroute.control.metrics import group_decisions
from fastroute.core.routing import Router
from fastroute.core.table import TargetTable
from fastroute.log import configure_logging
from fastroute.runtime.assemble import DRAIN_LINGER, assemble, drain, freeze_heap, listen
from fastroute.runtime.heap import Refreezer
from fastroute.runtime.startup import stop_on_signals, tls_context

# "fastroute.supervisor": the name operators filter process events on.
log = logging.getLogger("fastroute.supervisor")

STATS_INTERVAL = 0.25  # seconds between a proxy process's Stats reports
# Distinct RNG streams per process (ties and random picks must not move in lockstep).
SEED_STRIDE = 0x1000003


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when the supervisor dies (no orphaned listeners)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _load_config(state_dir: str) -> Config:
    with open(os.path.join(state_dir, "config.pickle"), "rb") as f:
        return pickle.load(f)


async def serve_child(state_dir: str, slot: int) -> int:
    """Serve as proxy process ``slot`` until SIGTERM/SIGINT or the supervisor's exit."""
    cfg = _load_config(state_dir)
    with open(os.path.join(state_dir, "child.json")) as f:
        info = json.load(f)
    parent = os.getppid()
    loop = asyncio.get_running_loop()
    table = TargetTable.attach(info["table"])
    ledger = TargetTable.attach(info["ledgers"][slot])

    def follower(router: Router) -> FollowerRegistry:
        registry = FollowerRegistry(cfg, table, router, ledger, state_dir, info["control_url"], info["secret"])
        registry.poll()  # the current worker set before the App exists
        return registry

    seed = None if cfg.seed is None else int(cfg.seed) + SEED_STRIDE * (slot + 1)
    parts = await assemble(cfg, table, seed=seed, registry_factory=follower, monitor=False, metrics=False)
    app, registry = parts.app, parts.registry
    assert app is not None and isinstance(registry, FollowerRegistry)
    stop = asyncio.Event()  # (handlers before the listener: a SIGTERM from then on drains)
    stop_on_signals(loop, stop.set)
    listener = await listen(app, cfg.host, int(info["port"]), reuse_port=True, tls=tls_context(cfg))
    freeze_heap()
    registry.add_listener(Refreezer(loop).changed)
    app.start()
    report_path = os.path.join(state_dir, f"stats-{slot}.pickle")

    def report() -> None:
        # Policy decision counters live in this process's compiled pickers: carry their
        # current totals in the report so the supervisor's /metrics includes them.
        app.stats.decisions = group_decisions(registry._groups)
        doc = {"pid": os.getpid(), "version": registry.version, "ready": registry.ready(), "stats": app.stats}
        tmp = f"{report_path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(doc, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, report_path)

    async def background() -> None:
        every = max(1, round(STATS_INTERVAL / SYNC_INTERVAL))
        tick = 0
        while True:
            await asyncio.sleep(SYNC_INTERVAL)
            try:
                registry.poll()
                tick += 1
                if tick % every == 0:
                    report()
                if os.getppid() != parent:  # supervisor gone (PDEATHSIG is the fast path)
                    stop.set()
            except Exception:
                log.exception("proxy process %d background tick", slot)

    bg = loop.create_task(background(), name="sync")
    await stop.wait()
    # Readiness 503 at once; the shared port goes on accepting here while requests arrive.
    await drain(
        app,
        float(cfg.shutdown_grace_period_secs),
        log,
        f"proxy process {slot}",
        listener=listener,
        linger=DRAIN_LINGER,
        shared_port=True,  # the siblings drain on the same SO_REUSEPORT port
    )
    bg.cancel()
    try:
        report()
    except OSError:
        pass
    table.close()
    ledger.close()
    return 0


def main(state_dir: str, slot: int) -> int:
    """Entry point of one proxy process."""
    _die_with_parent()
    cfg = _load_config(state_dir)
    configure_logging(cfg.log_level, cfg.log_dir, json_lines=cfg.log_json)
    return uvloop.run(serve_child(state_dir, slot))


if __name__ == "__main__":
    if len(sys.argv) == 3:
        sys.exit(main(sys.argv[1], int(sys.argv[2])))
    sys.exit("usage: python -m fastroute.runtime.child STATE_DIR SLOT")
