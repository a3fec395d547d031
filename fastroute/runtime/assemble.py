"""Building one router process, written once: table -> router (groups) -> registry -> monitor ->
metrics -> breakers/reconciler -> App, and the one drain of an App at shutdown.

Three processes are built from these pieces, differing only in what they own:

* the single-process server: creates the table, registers and monitors workers, serves
  ``/metrics`` and requests (:func:`assemble` with everything);
* the ``--workers N`` supervisor: creates the table, registers and monitors workers, serves
  ``/metrics`` for all processes, runs the one reconciler of the shared table, serves no
  requests (``serve=False``);
* a proxy process (:mod:`fastroute.runtime.child`): attaches the table, mirrors the supervisor's
  workers through a :class:`~fastroute.control.follower.FollowerRegistry` (which has a ledger),
  serves requests, no monitor and no metrics listener (``monitor=False, metrics=False``).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastroute.config import Config
from fastroute.control import httpclient
from fastroute.control.engine import EngineCollector
from fastroute.control.kvevents import KvEvents, KvEventsCollector, parse_endpoint
from fastroute.control.leases import Reconciler
from fastroute.control.metrics import RECONCILE_MISMATCH, MetricsServer, Stats, new_stats, start_metrics
from fastroute.control.monitor import Monitor
from fastroute.control.registry import Registry
from fastroute.core.breaker import Breakers
from fastroute.core.routing import Router
from fastroute.core.table import TargetTable
from fastroute.dataplane.app import App
from fastroute.dataplane.tokenize import TokenizerError, Tokens
from fastroute.dataplane.tokenize import load as load_tokens
from fastroute.runtime.startup import StartupError, bind_error
from fastroute.tls import TLSConfigError, worker_context

log = logging.getLogger("fastroute.assemble")

DRAIN_POLL = 0.05  # seconds between in-flight checks while draining (control plane, not per request)
# A signal's drain keeps the listener open until nothing has been in flight for this long (or the
# grace period ends): a client sending one request after another is served, not refused.
DRAIN_LINGER = 1.0


@dataclass(eq=False)
class Assembly:
    """The parts of one router process, in build order (None where the process has none)."""

    config: Config
    table: TargetTable
    router: Router
    registry: Registry
    stats: Stats
    monitor: Monitor | None = None
    kv_events: KvEvents | None = None
    metrics: MetricsServer | None = None
    reconciler: Reconciler | None = None
    app: App | None = None


def listen_to_engines(
    config: Config, table: TargetTable, router: Router, registry: Registry, monitor: Monitor | None, picks: bool
) -> KvEvents:
    """The process's subscriptions to the workers' KV events and pushed loads
    (fastroute.control.kvevents), following the registry's ready workers. A process that
    places requests indexes the KV events for its cache_aware groups; the ``--workers N``
    supervisor, which places none, takes only the loads (the shared table's writer)."""
    configured = parse_endpoint(config.kv_events_endpoint, config.block_size) if config.kv_events_endpoint else None
    index = router.kv_index if picks else None
    kv = KvEvents(table, index, config.kv_events_stale_secs, configured, registry.own)
    kv.speed = router.speed  # --speed-aware: prefill ranks' pushed busy time feeds their rates
    registry.add_listener(lambda role: kv.sync(registry.ready_workers()))
    if monitor is not None:
        monitor.pushed = kv.pushed
    if index is not None:
        uses = [p for p in (config.policy, config.prefill_policy) if p == "cache_aware"]
        log.info(
            "--kv-events %s: %s; requests with input_ids are placed by the prefix each rank reports, "
            "text and chat requests by the approximate prefix tree (the router does not tokenize)",
            config.kv_events,
            "cache_aware reads the engine's KV events" if uses else "no cache_aware leg: only pushed loads are used",
        )
    else:
        log.info(
            "--kv-events %s with --workers %s: pushed loads are used; the proxy processes place by "
            "the approximate prefix tree (the precise index runs with --workers 1)",
            config.kv_events,
            config.workers,
        )
    return kv


def reads_tokens(config: Config) -> list[str]:
    """What reads a request's token count or ids under ``config`` (empty: nothing would)."""
    uses = []
    if config.kv_events != "off" and "cache_aware" in (config.policy, config.prefill_policy):
        uses.append("the KV-event prefix index")
    for flag, mode in (
        ("--decode-input-demand", config.decode_input_demand),
        ("--prefill-input-demand", config.prefill_input_demand),
        ("--decode-kv-fit", config.decode_kv_fit),
    ):
        if mode != "off":
            uses.append(flag)
    if config.rate_limit_tokens_per_second:
        uses.append("--rate-limit-tokens-per-second")
    return uses


def tokens_for(config: Config) -> Tokens | None:
    """The process's tokenizers (--tokenizer-path / --model-path), or None; a path that does
    not hold a usable tokenizer stops the start, naming the file."""
    try:
        tokens = load_tokens(config)
    except TokenizerError as exc:
        raise StartupError(f"--tokenizer-path: {exc}") from None
    if tokens is None:
        return None
    uses = reads_tokens(config)
    if not uses:
        tokens.close()
        log.warning(
            "--tokenizer-path is accepted and not used: no policy or limit reads token counts with "
            "these flags (the KV-event index under cache_aware, input demand, KV fit, the token rate "
            "limit); prompts are not tokenized"
        )
        return None
    log.info("prompts are tokenized exactly for %s", ", ".join(uses))
    return tokens


def reconciler_for(config: Config, table: TargetTable, stats: Stats) -> Reconciler:
    """The reconciler of a table. A mismatch is a fact about the table, so exactly one process
    runs it per table: the single-process server, or the supervisor under ``--workers N``."""
    return Reconciler(table, float(config.request_timeout_secs), lambda name: stats.reclaim(RECONCILE_MISMATCH))


async def assemble(
    config: Config,
    table: TargetTable,
    *,
    seed: int | None = None,
    registry_factory: Callable[[Router], Registry] | None = None,
    serve: bool = True,
    monitor: bool = True,
    metrics: bool = True,
    stats: Stats | None = None,
    picks: bool | None = None,
) -> Assembly:
    """Build one router process over ``table`` (created or attached by the caller, who owns it).

    ``seed`` defaults to ``config.seed``; ``registry_factory(router)`` builds the registry
    (default: a :class:`Registry` that registers workers itself). Nothing is started: the
    caller starts the App's listener, ``registry.start()`` and ``monitor.start()`` in its order.
    ``picks`` (default: ``serve``) says whether this process places requests (the endpoint
    picker does without serving them): only then does it index the engines' KV events.
    """
    loop = asyncio.get_running_loop()
    # One TLS client context per process for https:// workers: registration, health checks and
    # load polls (httpclient) and the data path (the App's pools) use the same settings.
    try:
        worker_tls = worker_context(
            config.ca_cert_paths,
            config.client_cert_path,
            config.client_key_path,
            [*config.worker_urls, *(u for u, _ in config.prefill), *config.decode],
        )
    except TLSConfigError as exc:  # a --ca-cert-paths file missing: one line, no traceback
        raise StartupError(str(exc)) from None
    httpclient.configure_tls(worker_tls)
    router = Router(table, seed=config.seed if seed is None else seed, config=config)
    registry = registry_factory(router) if registry_factory is not None else Registry(config, table, router)
    parts = Assembly(config, table, router, registry, stats if stats is not None else new_stats(config))
    if monitor:
        parts.monitor = Monitor(config, registry, table)
        parts.monitor.health_checks = parts.stats.health_checks  # smg_worker_health_checks_total
        registry.admin.dashboard.monitor = parts.monitor  # the main port's live view: hit rates
    if monitor and config.kv_events != "off":
        parts.kv_events = listen_to_engines(
            config, table, router, registry, parts.monitor, serve if picks is None else picks
        )
    if metrics:
        try:
            parts.metrics = await start_metrics(config, table, registry, parts.stats)
        except OSError as exc:
            raise bind_error("--prometheus-port", config.prometheus_host, int(config.prometheus_port), exc) from None
        if parts.monitor is not None:  # smg's engine gauges from the load polls
            parts.metrics.registry.register(EngineCollector(parts.monitor, registry))
            parts.metrics.dashboard.monitor = parts.monitor  # the live view's per-rank hit rate
        if parts.kv_events is not None:
            parts.metrics.registry.register(KvEventsCollector(parts.kv_events))
    # A proxy process's registry has a ledger of its own and follows the supervisor's, which
    # reconciles the shared table once for all processes.
    if getattr(registry, "ledger", None) is None:
        parts.reconciler = reconciler_for(config, table, parts.stats)
    if not serve and (config.tokenizer_path or config.model_path):
        checked = tokens_for(config)  # the same start-up check as the proxy processes'
        if checked is not None:
            checked.close()
    if serve:
        breakers = Breakers(
            table,
            int(table.capacity),
            config.cb_failure_threshold,
            config.cb_success_threshold,
            config.cb_timeout_duration_secs,
            not config.disable_circuit_breaker,
            name_of=registry.target_name,
            clock=loop.time,
        )
        tokens = tokens_for(config)
        if tokens is not None:
            tokens.counts = parts.stats.tokenized  # fastroute_tokenized_requests
        parts.app = App(
            config,
            registry,
            loop,
            breakers=breakers,
            reconciler=parts.reconciler,
            tokens=tokens,
            worker_tls=worker_tls,
        )
        parts.app.stats = parts.stats
    return parts


def freeze_heap() -> None:
    """Start-up is over: move what it made (modules, the config, the registry, the table
    views...) out of the garbage collector's sight, so that a collection, when one runs,
    walks only what requests made since, not the whole process."""
    gc.collect()
    gc.freeze()


async def listen(
    app: App, host: str, port: int, reuse_port: bool = False, tls: ssl.SSLContext | None = None
) -> asyncio.Server:
    """The client listener of ``app``, HTTPS when ``tls`` is given.

    Only the proxy processes of ``--workers N`` share a port (``reuse_port``): a single process
    that set SO_REUSEPORT would let a second router bind the same port and silently take half
    the traffic with a target table of its own, invisible to this one. A port in use is a StartupError."""
    loop = asyncio.get_running_loop()
    # A TLS handshake is part of reading the request head: bounded by the same timeout (the
    # default, 60 s, let idle sockets pile up), and counted from the accept (App.handshaking).
    app.tls_listener = tls is not None
    try:
        return await loop.create_server(
            # An extension type cannot subclass asyncio.BaseProtocol: ClientProtocol has its
            # methods (connection_made, data_received, ...) without being one by name.
            app.protocol_factory,  # type: ignore[arg-type]
            host,
            port,
            reuse_address=True,
            reuse_port=reuse_port and hasattr(socket, "SO_REUSEPORT"),
            backlog=4096,
            ssl=tls,
            ssl_handshake_timeout=app.limits.header_timeout if tls else None,
        )
    except OSError as exc:
        raise bind_error("--port", host, port, exc) from None


async def drain(
    app: App,
    grace: float,
    log: logging.Logger,
    label: str = "shutdown",
    listener: asyncio.AbstractServer | None = None,
    linger: float = 0.0,
    shared_port: bool = False,
) -> None:
    """Graceful end of an App, as smg drains: ``/readiness`` answers 503 from now on, every
    response closes its connection, and ``listener``, still open, goes on accepting and serving
    new requests while any is in flight or arriving. It closes once nothing has been in flight
    (no request being read, queued or answered) for ``linger`` seconds, so a client still sending
    between two requests is not refused, or when ``grace`` runs out; then what is left in flight
    gets until the end of ``grace``, and is aborted with the idle connections. A router with no
    client connection open at all when the drain starts closes at once: an idle router stops
    without waiting (launchers give it one second before SIGKILL). Not so a proxy process sharing
    its port with siblings (``shared_port``, --workers N): closing its listener while they drain
    would reset the connections the kernel had already queued on it, so it lingers as a busy one
    does and answers them (503 on /readiness)."""
    app.endpoints.draining = True
    app.stop_accepting()
    loop = asyncio.get_running_loop()
    now = loop.time()
    deadline = now + grace
    if listener is not None:
        linger = min(linger, grace)
        if not shared_port and not app.active and not app.live.handshaking and not app.live.connections:
            linger = 0.0  # nobody connected: nobody between two requests either
        quiet_since = now
        while now < deadline:
            if app.active or app.live.handshaking or app.busy_connections():
                quiet_since = now
            elif now - quiet_since >= linger:
                break
            await asyncio.sleep(DRAIN_POLL)
            now = loop.time()
        listener.close()
    while (app.active or app.busy_connections()) and loop.time() < deadline:
        await asyncio.sleep(DRAIN_POLL)
    if app.active:
        log.warning("%s: aborting %d requests still in flight", label, app.active)
    app.close()


async def stop_in_order(*parts: Any) -> None:
    """Stop the parts that live where the registry lives (discovery, replica sync, monitor,
    registry, metrics) in the order given; None is a part that never started."""
    for part in parts:
        if part is not None:
            done = part.stop()
            if inspect.isawaitable(done):
                await done
