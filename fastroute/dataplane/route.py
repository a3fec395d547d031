"""Per-target routes: everything needed to send a request to one target, resolved ahead of time.

A :class:`Route` is built when the target set changes (the App's targets listener), never per
request. It holds the target's keep-alive pool, the request framing constants (the ``Host``
value and the fixed ``Authorization`` line of the worker's key), the pre-encoded DP rank key
that regular ``--dp-aware`` and the PD decode leg inject, and what a PD prefill target
contributes to the bootstrap fields (host and port pre-encoded, its dp_size and rank). So an
attempt is: acquire a lease from the group, then send through ``routes[lease.target]``,
without looking at the registry or at worker fields.

Framing is the only copy of the client body per leg: a body with injected fields is framed
around its splice point (:func:`fastroute.dataplane.body.splice_point`), never built first; a body
sent as it came is not copied at all (the pool writes the framed head and the client's bytes
together).
"""

from __future__ import annotations

from typing import Any

from fastroute.dataplane import body as _body
from fastroute.dataplane._splice import framed, post_head
from fastroute.dataplane.request import Request  # noqa: F401 (the compiled build types with it)
from fastroute.dataplane.upstream import Pool

# Bodies from this size on are written around spliced fields as views, not framed whole.
_VIEWS_FROM = 16384


def rank_port(w: Any, rank: int | None) -> int | None:
    """The port of target ``rank`` of a per-rank-port server (base port + rank,
    fastroute.control.rankports); None for any other target (it is served on the worker's port)."""
    if rank is not None and getattr(w, "rank_urls", None):
        return int(w.port) + rank
    return None


class Route:
    """How to reach one target (see module docstring); immutable once built."""

    __slots__ = (
        "worker",
        "pool",
        "authority",
        "host_part",
        "auth",
        "rank_field",
        "bootstrap",
        "prefill_dp_size",
        "prefill_rank",
        "index",
        "port",
        "prefill_rank_field",
    )

    def __init__(
        self,
        worker: Any,
        rank: int | None,
        pool: Pool,
        api_key: str | None,
        rank_field: str | None,
        port: int | None = None,
    ) -> None:
        self.worker = worker  # identity only: which worker the pool belongs to
        self.pool = pool
        # The target's index in the worker (the rank index when split), and the port it is
        # sent to: the worker's, or the rank's own on a per-rank-port server.
        self.index = rank
        self.port = int(worker.port) if port is None else int(port)
        self.authority = ("%s:%d" % (worker.host, self.port)).encode("idna")
        # The fixed middle of every request head to this target (frame writes the rest).
        self.host_part = b" HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\nContent-Length: " % (
            self.authority
        )
        # With --api-key (or a per-worker key from POST /workers) the worker always gets that
        # key; the client's own header was checked equal. Else the Basic credentials of the
        # worker's URL (user:password@, stripped from the URL itself), if any. Without
        # either, the client's header (if any) is forwarded as it came.
        basic = getattr(worker, "basic_auth", None)
        self.auth = (
            b"Authorization: Bearer " + api_key.encode("latin-1") + b"\r\n"
            if api_key
            else b"Authorization: " + basic.encode("latin-1") + b"\r\n"
            if basic
            else b""
        )
        # ``"<field>":<rank>`` for the body of a leg that targets one DP rank, else None.
        # A per-rank-port server's rank index is its port's offset; the DP rank is the one
        # that port reported (they differ only on the second node of a multi-node server).
        ids = getattr(worker, "rank_ids", None)
        dp_rank = ids[rank] if ids and rank is not None and rank < len(ids) else rank
        self.rank_field = (
            _body.rank_field_bytes(rank_field, dp_rank) if rank_field is not None and dp_rank is not None else None
        )
        # As a PD prefill: the bootstrap host/port values, and the rank the room must encode
        # (room % prefill_dp_size == rank, protocol.md 4.3); a target that is not one DP rank
        # of a split worker uses dp_size 1.
        self.bootstrap = _body.bootstrap_values(worker.host, worker.bootstrap_port)
        self.prefill_dp_size = int(worker.dp_size) if rank is not None else 1
        self.prefill_rank = dp_rank
        # A per-rank-port prefill rank also tells the decode which rank holds the KV
        # (``"disagg_prefill_dp_rank":p`` on the decode leg), as the room does for a classic one.
        self.prefill_rank_field = (
            _body.rank_field_bytes("disagg_prefill_dp_rank", dp_rank) if ids and dp_rank is not None else None
        )

    def frame(self, req: Request, length: int) -> bytes:
        """The upstream request head for ``req`` with a body of ``length`` bytes."""
        auth = self.auth
        if not auth and req.auth is not None:
            auth = b"Authorization: " + req.auth + b"\r\n"
        return post_head(req.url, self.host_part, length, req.fwd, auth)

    def send_injected(self, req: Request, end: int, sep: bytes, fields: bytes, leg: Any) -> None:
        """Send ``req`` with ``fields`` spliced into its body at ``end`` after ``sep`` (from
        ``body.splice_point``). A small body is framed whole, head and all, in one allocation
        (its copy is cheap, and the kernel gets one iovec). A large one goes out as the framed
        head and views of the client's bytes around the fields (one writev): no leg copies it,
        and a request waiting for its connection holds no copy."""
        body = req.body
        mid = sep + fields
        n = len(body) + len(mid)
        if n < _VIEWS_FROM:
            self.pool.send(framed(self.frame(req, n), body, end, mid), leg)
        else:
            view = memoryview(body)
            self.pool.send(self.frame(req, n), leg, False, (view[:end], mid, view[end:]))

    def send(self, req: Request, leg: Any) -> None:
        """Regular mode: send the client body as it came, beside its framed head (one writev),
        so a request waiting for its connection or its answer holds no second copy of it; or
        with this target's rank key when the target is one DP rank."""
        field = self.rank_field
        if field is None:
            body = req.body
            self.pool.send(self.frame(req, len(body)), leg, False, body if body else None)
        else:
            end, sep = _body.splice_point(req.body)
            self.send_injected(req, end, sep, field, leg)
