"""KV events and pushed loads of a simulated server, on the wire SGLang 0.5.23 uses.

Publisher (one set of sockets per DP rank r, bound on the worker's host):

* KV events: a ZMQ PUB on ``kv_base + r`` sends ``[topic, seq, payload]`` per batch; ``seq`` is
  8 bytes big-endian, from 0 per publisher; ``payload`` is msgpack ``[ts, events, rank]`` where
  each event is a map tagged by ``type``: ``BlockStored {block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium}``, ``BlockRemoved {block_hashes, medium}``,
  ``AllBlocksCleared {}`` (msgspec tagged structs with ``omit_defaults``: the required
  ``parent_block_hash`` and ``lora_id`` are always there, nil when None; ``medium`` is "GPU").
  The first batch (seq 0) is ``[AllBlocksCleared]``, as SGLang's cache reset at start-up.
* Replay: a ZMQ ROUTER on ``replay_base + r``. A DEALER sending ``[b"", start seq]`` (or a REQ
  sending the seq) gets every buffered batch with seq >= start as ``[b"", topic, seq, payload]``
  and then the end marker ``[b"", b"", -1 (8 bytes, signed), b""]``. The last
  ``kv_events_buffer_steps`` batches are kept.
* Loads: a ZMQ PUB on ``load_base + r`` sends ``[b"load", seq, LoadStat]``, LoadStat being the
  tagged array ``["LoadStat", num_running_reqs, num_waiting_reqs, num_tokens,
  max_total_num_tokens, attn_dp_rank, num_waiting_uncached_tokens, num_total_tokens,
  max_running_requests, total_prefill_uncached_tokens, total_prefill_busy_us]``. A rank sends
  when its stat changes (the engine pokes at once; the rest is polled every 50 ms) and re-sends an
  unchanged one every second. ``total_prefill_busy_us`` is in wall microseconds (the simulator's
  time, scaled by ``time_scale``).

Ports (``--kv-events-port-base B``; 0 = off, -1 = the first free run found): replay at
``--kv-events-replay-port-base`` (-1 = auto: ``B + dp_size``; 0 = no replay) and loads at
``--load-publish-port-base`` (-1 = auto: after the KV and replay ranges; 0 = no loads). With
``--kv-events-advertise`` (the default) ``/server_info`` carries::

    "kv_events": {"publisher": "zmq", "endpoint_host": "*", "endpoint_port_base": B,
                  "topic": "", "block_size": prefix_block_tokens, "dp_size": dp_size,
                  "replay_endpoint_port_base": R, "load_endpoint_port_base": L,
                  "load_topic": "load"}

(the replay key only with replay, the load keys only with loads). ``endpoint_host`` is the
wildcard SGLang's default endpoint advertises: a subscriber dials the worker URL's host.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Callable
from itertools import count
from typing import TYPE_CHECKING, Any

import msgspec
import zmq
import zmq.asyncio

from fastroute.sim.http import ephemeral_low

if TYPE_CHECKING:
    from fastroute.sim.params import SimParams

LOAD_TOPIC = b"load"
LOAD_TICK_S = 0.05  # loads not poked by the engine are polled this often
LOAD_HEARTBEAT_S = 1.0  # an unchanged stat is re-sent this often
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """A KV cache event: a msgpack map whose ``type`` is the class name."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list
    attn_dp_rank: int | None = None


class LoadStat(msgspec.Struct, array_like=True, tag=True, gc=False):
    num_running_reqs: int
    num_waiting_reqs: int
    num_tokens: int
    max_total_num_tokens: int
    attn_dp_rank: int
    num_waiting_uncached_tokens: int
    num_total_tokens: int
    max_running_requests: int
    total_prefill_uncached_tokens: int
    total_prefill_busy_us: int


def _ranges_overlap(a: int, b: int, n: int) -> bool:
    return a < b + n and b < a + n


def resolve_ports(p: SimParams, kv_base: int) -> tuple[int | None, int | None]:
    """(replay base, load base) for a KV range at ``kv_base``; None = that socket is off.

    Raises ``ValueError`` naming the flag when explicit ranges overlap or pass port 65535."""
    n = p.dp_size
    replay: int | None = p.kv_events_replay_port_base
    if replay == -1:
        replay = kv_base + n
    elif replay == 0:
        replay = None
    load: int | None = p.load_publish_port_base
    if load == -1:
        load = kv_base + n
        if replay is not None and _ranges_overlap(load, replay, n):
            load = replay + n
    elif load == 0:
        load = None
    named = [("--kv-events-port-base", kv_base), ("--kv-events-replay-port-base", replay)]
    named.append(("--load-publish-port-base", load))
    active = [(f, b) for f, b in named if b is not None]
    for i, (flag, base) in enumerate(active):
        if base + n - 1 > 65535:
            raise ValueError(f"{flag}: {n} ports from {base} run past 65535")
        for other, ob in active[:i]:
            if _ranges_overlap(base, ob, n):
                raise ValueError(f"{flag}: ports [{base}, {base + n}) overlap {other}'s [{ob}, {ob + n})")
    return replay, load


def _tcp(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class _Rank:
    """The sockets and the replay buffer of one DP rank."""

    __slots__ = ("pub", "replay", "load", "seq", "buffer", "load_seq", "last_load", "last_load_t", "task", "drop")

    def __init__(self, buffer_steps: int) -> None:
        self.pub: zmq.Socket | None = None
        self.replay: zmq.asyncio.Socket | None = None
        self.load: zmq.Socket | None = None
        self.seq = count()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.load_seq = count()
        self.last_load: tuple | None = None
        self.last_load_t = 0.0
        self.task: asyncio.Task | None = None
        self.drop = 0  # the next batches to keep for replay but not send (a fault for tests)


class KvEventsHub:
    """Every rank's publishers of one simulated server.

    ``load_of(rank)`` gives the rank's load as the LoadStat fields without ``attn_dp_rank``:
    (running, waiting, num_tokens, capacity, waiting uncached tokens, num_total_tokens,
    max_running_requests, total prefill uncached tokens, total prefill busy us)."""

    def __init__(self, params: SimParams, host: str, load_of: Callable[[int], tuple]) -> None:
        self._p = params
        self._host = host
        self._load_of = load_of
        self._topic = params.kv_events_topic.encode()
        self._enc = msgspec.msgpack.Encoder()
        self._ctx: zmq.Context | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._ranks: list[_Rank] = []
        self._ticker: asyncio.Task | None = None
        self.kv_base = 0
        self.replay_base: int | None = None
        self.load_base: int | None = None
        self.replay_requests = 0
        self.bad_replay_requests = 0

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Bind every socket (fails naming the flag when a port is taken), publish each rank's
        start-up ``AllBlocksCleared`` (seq 0) and start the replay servers and the load ticker."""
        p = self._p
        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx)
        try:
            if p.kv_events_port_base == -1:
                self._bind_free_run()
            else:
                self._bind(p.kv_events_port_base)
        except BaseException:
            await self.stop()
            raise
        loop = asyncio.get_running_loop()
        for i, rk in enumerate(self._ranks):
            if rk.replay is not None:
                rk.task = loop.create_task(self._serve_replay(rk))
            self.publish(i, [AllBlocksCleared()])
        if self.load_base is not None:
            for i in range(len(self._ranks)):
                self.poke(i)
            self._ticker = loop.create_task(self._tick())

    def _bind_free_run(self) -> None:
        n = self._p.dp_size
        hi = ephemeral_low() - 3 * n
        rng = random.Random()
        for _ in range(50):
            try:
                self._bind(rng.randrange(20000, hi) if hi > 20000 else 20000)
                return
            except (OSError, zmq.ZMQError):
                continue
        raise OSError("--kv-events-port-base -1: found no free run of ports")

    def _bind(self, kv_base: int) -> None:
        p, host = self._p, self._host
        replay, load = resolve_ports(p, kv_base)
        assert self._ctx is not None and self._actx is not None
        ranks = [_Rank(p.kv_events_buffer_steps) for _ in range(p.dp_size)]
        ipv6 = ":" in host
        flag = ""
        try:
            for r, rk in enumerate(ranks):
                flag = "--kv-events-port-base"
                rk.pub = self._socket(self._ctx, zmq.PUB, 100_000, ipv6, _tcp(host, kv_base + r))
                if replay is not None:
                    flag = "--kv-events-replay-port-base"
                    rk.replay = self._socket(self._actx, zmq.ROUTER, 100_000, ipv6, _tcp(host, replay + r))
                if load is not None:
                    flag = "--load-publish-port-base"
                    rk.load = self._socket(self._ctx, zmq.PUB, 8, ipv6, _tcp(host, load + r))
        except zmq.ZMQError as exc:
            for rk in ranks:
                for s in (rk.pub, rk.replay, rk.load):
                    if s is not None:
                        s.close(linger=0)
            raise OSError(f"{flag}: cannot bind on {host}: {exc}") from None
        self._ranks = ranks
        self.kv_base, self.replay_base, self.load_base = kv_base, replay, load

    @staticmethod
    def _socket(ctx: Any, kind: int, hwm: int, ipv6: bool, endpoint: str) -> Any:
        sock = ctx.socket(kind)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.set_hwm(hwm)
            if ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        return sock

    async def stop(self) -> None:
        tasks = [t for t in [self._ticker] + [rk.task for rk in self._ranks] if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._ticker = None
        for rk in self._ranks:
            for s in (rk.pub, rk.replay, rk.load):
                if s is not None:
                    s.close(linger=0)
        self._ranks = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = self._actx = None

    # -- KV events ---------------------------------------------------------------------------
    def publish(self, rank: int, events: list) -> None:
        """Send one batch of ``events`` on ``rank``'s PUB and keep it for replay."""
        if not self._ranks:
            return
        rk = self._ranks[rank]
        seq = next(rk.seq)
        payload = self._enc.encode(_Batch(time.time(), events, rank))
        rk.buffer.append((seq, payload))
        if rk.drop > 0:
            rk.drop -= 1
            return
        assert rk.pub is not None
        with contextlib.suppress(zmq.Again):  # PUB drops at its high-water mark, never blocks
            rk.pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    def drop(self, rank: int, n: int) -> None:
        """A fault for tests: ``rank``'s next ``n`` batches are numbered and kept for replay but
        not sent (a subscriber sees a gap in seq; a large ``n`` is a silent publisher)."""
        self._ranks[rank].drop = n

    def sink(self, rank: int) -> Callable[[list], None]:
        return lambda events: self.publish(rank, events)

    async def _serve_replay(self, rk: _Rank) -> None:
        sock = rk.replay
        assert sock is not None
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                self.bad_replay_requests += 1
                continue
            ident, _, start_b = frames
            self.replay_requests += 1
            start = int.from_bytes(start_b, "big")
            for seq, payload in [x for x in rk.buffer if x[0] >= start]:
                await sock.send_multipart((ident, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((ident, b"", b"", END_SEQ, b""))

    # -- loads -------------------------------------------------------------------------------
    def poke(self, rank: int) -> None:
        """Send ``rank``'s LoadStat if it changed (or a heartbeat is due)."""
        if self.load_base is None or not self._ranks:
            return
        rk = self._ranks[rank]
        counts = tuple(self._load_of(rank))
        now = time.monotonic()
        if counts == rk.last_load and now - rk.last_load_t < LOAD_HEARTBEAT_S:
            return
        c = counts
        stat = LoadStat(c[0], c[1], c[2], c[3], rank, c[4], c[5], c[6], c[7], c[8])
        assert rk.load is not None
        seq = next(rk.load_seq).to_bytes(8, "big")
        with contextlib.suppress(zmq.Again):
            rk.load.send_multipart((LOAD_TOPIC, seq, self._enc.encode(stat)), flags=zmq.NOBLOCK)
        rk.last_load, rk.last_load_t = counts, now

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(LOAD_TICK_S)
            for i in range(len(self._ranks)):
                self.poke(i)

    # -- discovery ---------------------------------------------------------------------------
    def describe(self) -> dict | None:
        """The ``kv_events`` block of ``/server_info`` (None when not advertised)."""
        if not self._p.kv_events_advertise or not self._ranks:
            return None
        d: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": "*",
            "endpoint_port_base": self.kv_base,
            "topic": self._p.kv_events_topic,
            "block_size": self._p.prefix_block_tokens,
            "dp_size": self._p.dp_size,
        }
        if self.load_base is not None:
            d["load_endpoint_port_base"] = self.load_base
            d["load_topic"] = LOAD_TOPIC.decode()
        if self.replay_base is not None:
            d["replay_endpoint_port_base"] = self.replay_base
        return d
