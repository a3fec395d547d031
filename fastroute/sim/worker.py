"""Simulated SGLang prefill/decode servers with DP attention: in-process clusters and the CLI
(``python -m fastroute.sim.worker``).

The pieces: ``engine`` (the timing, KV and rendezvous model), ``api`` (request parsing and
response bodies), ``server`` (``SimWorker``, one server's HTTP surface). This module only starts
them: ``start_cluster`` for tests and benchmarks, ``main`` for a separate process.
"""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass, field, fields

import uvloop

from fastroute.sim.dispatch import LB_METHODS
from fastroute.sim.engine import Rendezvous, SimParams
from fastroute.sim.server import SimWorker


@dataclass
class SimCluster:
    """Prefill and decode simulators sharing one event loop (and so one rendezvous map)."""

    prefills: list[SimWorker] = field(default_factory=list)
    decodes: list[SimWorker] = field(default_factory=list)
    boards: dict[int, Rendezvous] = field(default_factory=dict)

    async def stop(self) -> None:
        for w in self.decodes + self.prefills:
            await w.stop()


async def start_cluster(
    n_prefill: int = 1,
    n_decode: int = 1,
    params: SimParams | None = None,
    prefill_params: SimParams | None = None,
    host: str = "127.0.0.1",
    rank_ports: bool = False,
    decode_params: list[SimParams] | None = None,
) -> SimCluster:
    """Start ``n_prefill`` prefill and ``n_decode`` decode simulators on ephemeral ports
    (``rank_ports``: each with one port per DP rank, like SGLang's Rust server);
    ``decode_params`` gives each decode its own parameters (mixed hardware)."""
    params = params or SimParams()
    cluster = SimCluster()
    for _ in range(n_prefill):
        w = SimWorker("prefill", prefill_params or params, host, 0, 0, cluster.boards, rank_ports)
        await w.start()
        cluster.prefills.append(w)
    for i in range(n_decode):
        own = decode_params[i] if decode_params else params
        w = SimWorker("decode", own, host, 0, None, cluster.boards, rank_ports)
        await w.start()
        cluster.decodes.append(w)
    return cluster


# ---------------------------------------------------------------------------------------------
# CLI


# --help of the KV events flags (fastroute.sim.kvevents describes the wire).
PARAM_HELP = {
    "kv_events_port_base": "publish KV events as SGLang 0.5.23 does: DP rank r's ZMQ PUB on this port + r, "
    "bound on --host (0 = off, -1 = a free run of ports); the cache is the prefill ranks' "
    "--prefix-cache-tokens, blocks of --prefix-block-tokens",
    "kv_events_replay_port_base": "rank r's replay ROUTER on this port + r (-1 = auto: KV base + dp_size; "
    "0 = no replay)",
    "load_publish_port_base": "rank r's LoadStat PUB (topic load) on this port + r (-1 = auto: after the KV and "
    "replay ranges; 0 = no loads)",
    "kv_events_advertise": "put the kv_events block in /server_info (--no-kv-events-advertise: publish "
    "without telling, for a router's --kv-events-endpoint)",
    "speed_factor": "mixed hardware: every decode step and prefill compute of this server lasts this many "
    "times the nominal model's (1.6: a server 1.6x slower)",
    "slowdown_at": "wall seconds after start from which the server runs --slowdown-factor times slower "
    "again (thermal throttling, a noisy neighbour); -1 = never",
    "slowdown_factor": "how many times slower the server runs from --slowdown-at on",
    "prefill_rank_rates": "each prefill rank's own tokens/s, comma separated, one per DP rank "
    "(default: --prefill-tokens-per-s on every rank)",
    "kv_events_topic": "ZMQ topic of the KV event batches",
    "kv_events_buffer_steps": "KV event batches each rank keeps for replay",
    "tokenizer_path": "a tokenizer directory (tokenizer.json, tokenizer_config.json): text prompts are "
    "tokenized and chat prompts rendered with its template and tokenized, as SGLang does, so their "
    "counts are exact and their blocks (and KV events) carry real token ids (default: 4 bytes a token)",
}


def add_param_flags(ap: argparse.ArgumentParser) -> None:
    """One ``--flag`` per SimParams field (dashes for underscores), defaults from the dataclass."""
    defaults = SimParams()
    for f in fields(SimParams):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        hlp = PARAM_HELP.get(f.name)
        if isinstance(default, bool):  # --retract / --no-retract (bool("False") would be True)
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, dest=f.name, help=hlp)
        elif f.name == "kv_transfer_scope":
            ap.add_argument(flag, choices=("server", "rank"), default=default, dest=f.name)
        elif f.name == "load_balance_method":  # SGLang's flag: the rank of a request naming none
            ap.add_argument(flag, choices=LB_METHODS, default=default, dest=f.name)
        else:
            ap.add_argument(flag, type=type(default), default=default, dest=f.name, help=hlp)


def params_from_args(ns: argparse.Namespace) -> SimParams:
    return SimParams(**{f.name: getattr(ns, f.name) for f in fields(SimParams)})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m fastroute.sim.worker", description="Simulated SGLang PD worker with DP attention"
    )
    ap.add_argument("--role", choices=("prefill", "decode", "regular"), required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument(
        "--bootstrap-port",
        type=int,
        default=0,
        help="prefill only: port of the simulated KV bootstrap listener (0 = ephemeral)",
    )
    ap.add_argument(
        "--rank-ports",
        action="store_true",
        help="one port per DP rank from --port up (SGLang's Rust server layout); a "
        "prefill then serves the bootstrap on its API ports",
    )
    add_param_flags(ap)
    ns = ap.parse_args(argv)
    try:
        params = params_from_args(ns)
    except ValueError as exc:
        ap.error(str(exc))

    try:
        w = SimWorker(ns.role, params, ns.host, ns.port, ns.bootstrap_port, rank_ports=ns.rank_ports)
    except ValueError as exc:
        ap.error(str(exc))

    async def run() -> None:
        await w.start()
        extra = f" bootstrap_port={w.bootstrap_port}" if ns.role == "prefill" else ""
        if w.rank_ports:
            extra += f" rank_ports={w.port}..{w.port + params.dp_size - 1}"
        kv = w.kv_events
        if kv is not None:
            extra += f" kv_events_port_base={kv.kv_base}"
            extra += f" replay_port_base={kv.replay_base or 0} load_port_base={kv.load_base or 0}"
        print(f"sim {ns.role} listening on {w.url} dp_size={params.dp_size}{extra}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await w.stop()

    try:
        uvloop.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
