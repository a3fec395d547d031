"""The `fastroute` command: sglang-router compatible flags, logging set-up, dispatch.

An operator replaces `python -m sglang_router.launch_router ARGS` with `fastroute ARGS`: every
sglang-router 0.3.2 flag keeps its meaning and default (the defaults are read from
`fastroute.config.Config`, the single source of truth), smg additions are accepted, each routing
flag also answers to its `--router-` spelling (as passed by `sglang.launch_server`), and flags
with no meaning for fastroute are accepted with one warning each.

This module builds the parser (:func:`build_parser`) from the flag definitions, the peers' in
`fastroute.config.peerflags` and fastroute's own in `fastroute.config.ownflags`, both written with the
machinery of `fastroute.config.flagparse`; it pre-scans the command line for the peers' flag families,
parses, and dispatches. Turning the namespace into a validated `Config` is `fastroute.config`'s
job; running it is `fastroute.runtime.server.run`'s (a `Server`, or a `Supervisor` under
`--workers N`). `fastroute demo ...` hands over to `fastroute.sim.demo`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

import fastroute.config.flags as flags
from fastroute import __version__
from fastroute.config.checks import PolicyFileError
from fastroute.config.flagparse import (  # noqa: F401 (IGNORED_FLAGS re-exported)
    IGNORED_FAMILIES,
    IGNORED_FLAGS,
    Adder,
    Parser,
    canonical,
    wants_json,
)
from fastroute.config.ownflags import add_own_groups
from fastroute.config.peerflags import add_inventory_groups, add_peer_groups
from fastroute.config.settings import Config, ConfigError, config_from_args
from fastroute.log import configure_logging, startup_error
from fastroute.runtime.server import Server, run
from fastroute.runtime.startup import StartupError
from fastroute.runtime.supervisor import Supervisor, resolve_processes

__all__ = ["build_parser", "parse_namespace", "parse_args", "configure_logging", "main"]


def build_parser(prog: str = "fastroute") -> argparse.ArgumentParser:
    """The full flag surface, grouped like sglang-router's --help."""
    parser = Parser(
        prog=prog,
        usage="%(prog)s [OPTIONS]  |  %(prog)s {demo,epp,sidecar} [OPTIONS]",
        description=(
            "fastroute: drop-in replacement for the SGLang router (sglang-router / smg) that "
            "balances prefill/decode disaggregated serving down to decode DP ranks. Every "
            "routing flag also accepts the --router- prefixed spelling (e.g. --router-policy)."
        ),
        epilog=(
            "Subcommands: 'fastroute demo' runs the built-in simulation demo; 'fastroute epp' is the "
            "Envoy endpoint picker (docs/epp.md); 'fastroute sidecar' relays PD legs on a decode pod. "
            "A simulated SGLang worker to route to: 'python -m fastroute.sim.worker --help'."
        ),
    )
    parser.add_argument("--version", action="version", version=f"fastroute {__version__}")
    add = Adder(parser)
    add_peer_groups(add)
    add_own_groups(add)
    add_inventory_groups(add)
    _common_first(parser)
    return parser


# The flags most launches need, shown first in --help (each stays defined in its own group's
# module; only the help listing moves). The peers' compatibility groups stay last.
COMMON_FLAGS = (
    "--host",
    "--port",
    "--worker-urls",
    "--pd-disaggregation",
    "--prefill",
    "--decode",
    "--policy",
    "--dp-aware",
    "--workers",
    "--api-key",
    "--prometheus-port",
    "--log-level",
)


def _common_first(parser: argparse.ArgumentParser) -> None:
    """Move COMMON_FLAGS into a first help group, "Common flags" (parsing is unchanged)."""
    common = parser.add_argument_group(
        "Common flags", "What most launches set; every group below has the rest (peer-compatible first)."
    )
    groups = parser._action_groups  # argparse keeps no public way to order help groups
    groups.remove(common)
    for name in COMMON_FLAGS:
        for group in groups:
            action = next((a for a in group._group_actions if name in a.option_strings), None)
            if action is not None:
                group._group_actions.remove(action)
                common._group_actions.append(action)
                break
        else:
            raise AssertionError(f"{name} is not a flag")  # a renamed flag must be renamed here
    first = next(i for i, g in enumerate(groups) if g._group_actions and g.title not in ("positional arguments",))
    groups.insert(first, common)


def _values(argv: Sequence[str], i: int) -> tuple[list[str], int]:
    """The values of the option at ``argv[i]`` and the index after them (values never start
    with "--"; a lone "-1" still counts as a value)."""
    token = argv[i]
    if "=" in token:
        return [token.split("=", 1)[1]], i + 1
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return list(argv[i + 1 : j]), j


def _strip_ignored_families(
    argv: Sequence[str],
) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Remove flag-family options (and their values) argparse cannot know by name."""
    kept: list[str] = []
    dropped: list[tuple[str, list[str]]] = []
    i = 0
    n = len(argv)
    while i < n:
        token = argv[i]
        if token == "--":
            kept.extend(argv[i:])
            break
        name = canonical(token)
        if token.startswith("--") and name.startswith(IGNORED_FAMILIES):
            row = flags.lookup(name)
            if row is not None and row.family:
                values, i = _values(argv, i)
                dropped.append((name, values))
                continue
        kept.append(token)
        i += 1
    return kept, dropped


def _pending_flags(argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Real fastroute flags the inventory lists as not yet effective, as given on the line."""
    found: list[tuple[str, list[str]]] = []
    for i, token in enumerate(argv):
        if token == "--":
            break
        name = canonical(token)
        if token.startswith("--") and name in flags.PARSED_NAMES:
            found.append((name, _values(argv, i)[0]))
    return found


def parse_namespace(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parse flags into a raw namespace (argparse exits with status 2 on a bad flag).

    ``ns.ignored_flags`` holds ``(flag, values)`` of every inventory flag given (see
    :mod:`fastroute.config.flags`); :func:`fastroute.config.config_from_args` judges them."""
    parser = parser or build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    if isinstance(parser, Parser):
        parser.json_errors = wants_json(args)
    kept, families = _strip_ignored_families(args)
    ns = argparse.Namespace(ignored_flags=[])
    parser.parse_args(kept, namespace=ns)
    ns.ignored_flags.extend(families)
    ns.ignored_flags.extend(_pending_flags(args))
    return ns


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse and validate a command line; exits with status 2 and a message naming the flag."""
    parser = build_parser()
    ns = parse_namespace(argv, parser)
    try:
        return config_from_args(ns)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _epp(args: list[str]) -> int:
    """``fastroute epp``: the router's flags plus the picker's (fastroute.epp.options)."""
    from fastroute.epp.options import FLOW_FLAGS, HELP, EppError, inert_flags, option_warnings, refusal, split

    head = args[: args.index("--")] if "--" in args else args
    if "-h" in head or "--help" in head:
        sys.stdout.write(HELP)
        router = build_parser("fastroute epp")
        router.usage = "fastroute epp --grpc-port G [OPTIONS]"
        router.epilog = None
        router.print_help()
        return 0
    json_errors = wants_json(args)
    try:
        opts, rest = split(args)
    except EppError as exc:
        startup_error(str(exc), json_errors)
        return 2
    parser = build_parser("fastroute epp")
    ns = parse_namespace(rest, parser)
    try:
        configure_logging(ns.log_level, ns.log_dir, json_lines=ns.log_json)
        config = config_from_args(ns, said_elsewhere={flag for _, flag in FLOW_FLAGS})  # refused below
    except OSError as exc:
        parser.error(f"argument --log-dir: {exc}")
    except ConfigError as exc:
        parser.error(str(exc))
    http_why = None
    if opts.mode == "http":  # why a pick would need the body ("" when none does)
        from fastroute.epp.decide import needs_body

        http_why = (
            "this configuration's picks read the body (DP rank, PD, tokens or prompt)" if needs_body(config) else ""
        )
    why = refusal(
        config, resolve_processes(config), opts.pool, opts.sidecar_port, opts.failure_mode, opts.fallbacks, http_why
    )
    if why is None and opts.pool is not None and not opts.print_config:
        from fastroute.kube import NO_KUBE_CONFIG, kube_config_source

        if kube_config_source() is None:
            why = f"argument --inference-pool: {NO_KUBE_CONFIG}"
    if why is not None:
        startup_error(why, json_errors)
        return 2
    for line in [*inert_flags(config, rest), *option_warnings(opts, args)]:
        logging.getLogger("fastroute.epp").warning("%s", line)
    if opts.print_config:
        from fastroute.epp.bootstrap import bootstrap_for

        assert opts.listen_port is not None  # parse_options requires it with --print-envoy-config
        sys.stdout.write(
            bootstrap_for(
                config,
                opts.grpc_port,
                opts.listen_port,
                opts.admin_port,
                opts.failure_mode,
                opts.envoy_tls,
                next_best=opts.fallbacks,
                mode=opts.mode,
            )
        )
        return 0
    try:
        from fastroute.epp.child import child_options, serve_many
        from fastroute.epp.server import serve as serve_epp
    except ImportError as exc:
        startup_error(
            f"fastroute epp needs grpcio, grpcio-health-checking and xds-protos (pip install 'fastroute[epp]'): {exc}",
            json_errors,
        )
        return 2
    import uvloop

    try:
        if resolve_processes(config) > 1:  # --workers N: picker processes on one table
            opts_json = child_options(
                opts.sidecar_port, opts.tls, opts.silent_timeout, opts.max_streams, opts.fallbacks, opts.mode
            )
            return uvloop.run(serve_many(config, opts.grpc_port, opts_json))
        return uvloop.run(
            serve_epp(
                config,
                opts.grpc_port,
                opts.pool,
                opts.pool_namespace,
                opts.sidecar_port,
                tls=opts.tls,
                silent_timeout=opts.silent_timeout,
                max_streams=opts.max_streams,
                fallbacks=opts.fallbacks,
                mode=opts.mode,
            )
        )
    except (StartupError, ConfigError) as exc:
        startup_error(str(exc), json_errors)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int | None:
    """Entry point of the `fastroute` console script and `python -m fastroute`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "demo":
        # Deferred: the simulator (and its load generator) loads only for `fastroute demo`.
        from fastroute.sim.demo import main as demo_main

        return demo_main(args[1:])
    if args and args[0] == "epp":
        return _epp(args[1:])
    sidecar = bool(args) and args[0] == "sidecar"  # the PD relay of a decode pod (epp)
    if sidecar:
        args = args[1:]
    if args and args[0] == "launch":
        # `smg launch ARGS` / `sglang-router launch ARGS` spelling.
        args = args[1:]
    parser = build_parser()
    ns = parse_namespace(args, parser)
    try:
        configure_logging(ns.log_level, ns.log_dir, json_lines=ns.log_json)
    except OSError as exc:
        parser.error(f"argument --log-dir: {exc}")
    try:
        config = config_from_args(ns)
    except PolicyFileError as exc:  # a flow-control YAML it cannot use: a start-up error
        startup_error(str(exc), ns.log_json)
        return 1
    except ConfigError as exc:
        parser.error(str(exc))
    # One process serves, or (--workers N, N > 1) a supervisor runs N proxy processes.
    factory: Any = Supervisor if resolve_processes(config) > 1 else Server
    if sidecar:
        from fastroute.epp.sidecar import SidecarServer
        from fastroute.epp.sidecar import refusal as sidecar_refusal

        why = sidecar_refusal(config, resolve_processes(config))
        if why is not None:
            parser.error(why)
        factory = SidecarServer
    try:
        return run(config, factory)
    except StartupError as exc:
        # One line, no traceback: a port in use or a TLS file that cannot be used.
        startup_error(str(exc), ns.log_json)
        return 1
    except ConfigError as exc:
        # Found while starting (an unusable Kubernetes configuration): refused like a flag.
        startup_error(str(exc), ns.log_json)
        return 2
    except KeyboardInterrupt:
        return 130
