"""``fastroute sidecar``: the PD relay on a decode pod, taking its pair from the picker.

Under ``fastroute epp --pd-disaggregation --sidecar-port P`` the picker books a prefill and a
decode target (the proxy's PD pick, with its policies and in-flight counts) and Envoy sends the
request to ``<decode pod IP>:P``, where this sidecar runs: the router in PD mode (the same
flags, workers and relay as ``fastroute --pd-disaggregation``), except that its prefill and
decode groups do not pick. They book the targets the picker named in ``x-smg-routing-key`` as
``PREFILL|DECODE`` target names (a worker URL, ``URL@RANK`` for a DP rank), so the relay's
dual dispatch, bootstrap room, rank fields, logprob merge and error mapping are the proxy's. A
request without such a pair, or naming a target this sidecar does not have (not registered or
not available here), gets the relay's 503 for that leg: the sidecar never picks on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastroute.config import Config
from fastroute.runtime.server import Server

ROLES = ("prefill", "decode")


def refusal(config: Any, processes: int) -> str | None:
    """Why a router configuration cannot run as the sidecar, or None."""
    if not config.pd_disaggregation:
        return (
            "argument --pd-disaggregation: required by fastroute sidecar (it relays the "
            "prefill and decode legs the endpoint picker chose)"
        )
    if processes > 1:
        return "argument --workers: fastroute sidecar runs as one process"
    if config.enable_igw:
        return "argument --enable-igw: not supported by fastroute sidecar"
    return None


class PinnedGroup:
    """A role's group that books the target the picker named instead of picking one."""

    def __init__(self, group: Any, index: int) -> None:
        self.group = group
        self.index = index  # 0: the prefill name of the pair, 1: the decode name

    def acquire(self, tokens: int = 0, key: bytes | None = None, meta: Any = None, out_tokens: int = 0) -> Any:
        if not key:
            return None
        pair = key.split(b"|")
        if len(pair) != 2:
            return None
        name = pair[self.index].decode("latin-1")
        g = self.group
        try:
            t = g.targets[g.names.index(name)]
        except ValueError:
            return None
        return g.book_target(t, tokens)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.group, attr)


def pin_groups(registry: Any) -> None:
    """Replace the registry's PD groups by pinned ones (keeping their targets up to date)."""
    for i, role in enumerate(ROLES):
        g = registry._groups[role]
        if not isinstance(g, PinnedGroup):
            registry._groups[role] = PinnedGroup(g, i)


class SidecarServer(Server):
    """The router process of ``fastroute sidecar`` (see module docstring). Its worker set comes
    from its flags or discovery, so its worker-management routes stay closed (403) unless a key
    guards them or ``--allow-open-admin`` opens them: anyone reaching the port could otherwise
    make it call any host (fastroute.runtime.server.run does not refuse it to start)."""

    closes_open_admin = True

    def __init__(self, config: Config) -> None:
        super().__init__(dataclasses.replace(config, admin_closed=not config.allow_open_admin))

    async def start(self) -> None:
        await super().start()
        # Before any worker is ready (registration runs in the background), so no request is
        # ever routed by the groups' own policies: until then every request gets 503.
        assert self.registry is not None
        pin_groups(self.registry)
