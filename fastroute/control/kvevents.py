"""Listening to the engine: per-rank KV events and pushed loads over ZMQ (SGLang 0.5.23+).

A worker started with ``--kv-events-config`` advertises its publishers in ``/server_info``
under ``kv_events`` (protocol.md 13): ``endpoint_port_base`` (rank r publishes on base + r),
``replay_endpoint_port_base``, ``topic``, ``block_size``, ``dp_size`` and, with
``--load-publish-endpoint``, ``load_endpoint_port_base`` and ``load_topic``. The host is
always the worker URL's host (the advertised ``endpoint_host`` is usually a bind wildcard, and
a worker may not send the router to another host). ``--kv-events-endpoint`` names the same for
servers that publish without advertising.

:class:`KvEvents` keeps one subscription per rank target of every ready worker that
publishes: a SUB socket for KV events (feeding :class:`~fastroute.core.kvindex.KvIndex`) and,
where advertised, a SUB socket for loads (written into the target table like a poll, and the
poll of that rank then leaves them alone). Subscriptions follow the registry: a worker that
is removed, restarts with another dp_size or another layout is re-subscribed from scratch.

One rank's stream, in order:

* cold start: connect, then ask the replay socket for every batch from seq 0; when the
  publisher's buffer reaches back to seq 0 (or the publisher has published nothing yet) the
  index is whole and used at once, else it warms up (``KvIndex.warmup_secs``);
* a batch whose seq skips ahead is a gap: the missing batches are replayed; a gap the replay
  cannot fill, a seq going back (the publisher restarted) or silence on both the KV and load
  sockets longer than ``--kv-events-stale-secs`` mark the rank stale: its index is cleared,
  placement falls back to the approximate tree until the rank has been whole for the warm-up;
* a batch that does not decode is counted and skipped (its seq is consumed); the stream goes
  on. A burst is applied in slices of ``SLICE_BLOCKS`` blocks, yielding to the loop between.

Each subscription is its own task: a failure (a socket error, a replay timeout) is logged
once per episode and retried after a capped backoff, so no stream ends silently.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec

from fastroute.control.background import backoff_delay
from fastroute.control.worker import Worker
from fastroute.core.kvindex import KvIndex
from fastroute.core.table import COL_POLLED_KV_QUEUE, TargetTable

log = logging.getLogger("fastroute.kvevents")

# Blocks applied before the subscription yields to the event loop (a burst of 100k blocks is
# applied over many loop iterations).
SLICE_BLOCKS = 2048
# How long one replay may take before it counts as failed.
REPLAY_TIMEOUT = 5.0
# A pushed stat older than this no longer stands in for the /v1/loads poll.
PUSH_FRESH_SECS = 3.0
# Batches queued per KV subscription before ZMQ drops (the publisher's default high-water mark).
RCV_HWM = 100_000
_END = -1
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]", "")


# ---- the wire (protocol.md 13), decoded by shape ---------------------------------------------
class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    attn_dp_rank: int | None = None


class Stored(msgspec.Struct, tag="BlockStored"):
    kind: ClassVar[str] = "stored"
    block_hashes: list[int]
    token_ids: list[int]
    block_size: int
    parent_block_hash: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    cache_salt: str | None = None
    lora_name: str | None = None


class Removed(msgspec.Struct, tag="BlockRemoved"):
    kind: ClassVar[str] = "removed"
    block_hashes: list[int]
    medium: str | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    kind: ClassVar[str] = "cleared"


_batch_decoder = msgspec.msgpack.Decoder(_Batch)
_event_decoder = msgspec.msgpack.Decoder(Stored | Removed | Cleared)
_any_decoder = msgspec.msgpack.Decoder()


def decode_load(payload: bytes) -> tuple[int, int, int, int, int] | None:
    """(running, waiting, KV tokens used, KV capacity or -1, waiting uncached tokens) of a
    LoadStat (``["LoadStat", running, waiting, tokens, capacity, rank, uncached, ...]``), or
    None when the payload is not one."""
    try:
        doc = _any_decoder.decode(payload)
    except (msgspec.DecodeError, ValueError):
        return None
    if not isinstance(doc, list) or len(doc) < 5 or doc[0] != "LoadStat":
        return None
    vals = doc[1:5] + (doc[6:7] if len(doc) > 6 else [0])
    if not all(type(v) is int and 0 <= v < (1 << 62) for v in vals):
        return None
    running, waiting, tokens, cap, uncached = vals
    return running, waiting, tokens, cap if cap > 0 else -1, uncached


def prefill_counters(payload: bytes) -> tuple[int, int] | None:
    """(total_prefill_uncached_tokens, total_prefill_busy_us) of a LoadStat that carries them
    (SGLang's fields 9 and 10), else None."""
    try:
        doc = _any_decoder.decode(payload)
    except (msgspec.DecodeError, ValueError):
        return None
    if not isinstance(doc, list) or len(doc) < 11 or doc[0] != "LoadStat":
        return None
    unc, busy = doc[9], doc[10]
    if type(unc) is not int or type(busy) is not int or unc < 0 or busy < 0:
        return None
    return unc, busy


# ---- where a worker publishes -----------------------------------------------------------------
@dataclass(frozen=True)
class Publisher:
    """One worker's advertised (or configured) publishers."""

    host: str
    kv_base: int
    topic: str
    block_size: int
    dp_size: int
    replay_base: int | None = None
    load_base: int | None = None
    load_topic: str = "load"

    def endpoint(self, base: int, rank: int) -> str:
        return f"tcp://{self.host}:{base + rank}"


def _port(v: Any, span: int) -> int | None:
    if type(v) is not int or v < 1 or v + span - 1 > 65535:
        return None
    return v


def publisher_of(w: Worker, configured: Publisher | None = None) -> tuple[Publisher | None, str | None]:
    """(the worker's publishers, None) or (None, why not) from its ``/server_info``; a
    ``configured`` one (``--kv-events-endpoint``) applies to workers that advertise none."""
    host = w.host
    doc = w.server_info.get("kv_events") if isinstance(w.server_info, dict) else None
    if doc is None:
        if configured is None:
            return None, "no kv_events in /server_info"
        return Publisher(
            host,
            configured.kv_base,
            configured.topic,
            configured.block_size,
            w.dp_size,
            configured.replay_base,
            configured.load_base,
            configured.load_topic,
        ), None
    if not isinstance(doc, dict):
        return None, "kv_events is not an object"
    if doc.get("publisher", "zmq") != "zmq":
        return None, f"publisher {doc.get('publisher')!r} is not zmq"
    dp = doc.get("dp_size", w.dp_size)
    if type(dp) is not int or not 1 <= dp <= 4096:
        return None, f"dp_size {dp!r} is not a rank count"
    bs = doc.get("block_size")
    if type(bs) is not int or not 1 <= bs <= 1 << 20:
        return None, f"block_size {bs!r} is not a block size"
    kv = _port(doc.get("endpoint_port_base"), dp)
    if kv is None:
        return None, f"endpoint_port_base {doc.get('endpoint_port_base')!r} is not a port range of {dp}"
    topic = doc.get("topic", "")
    load_topic = doc.get("load_topic", "load")
    if not isinstance(topic, str) or not isinstance(load_topic, str):
        return None, "topic is not a string"
    replay = doc.get("replay_endpoint_port_base")
    load = doc.get("load_endpoint_port_base")
    replay_port = _port(replay, dp) if replay is not None else None
    load_port = _port(load, dp) if load is not None else None
    if (replay is not None and replay_port is None) or (load is not None and load_port is None):
        return None, "replay or load port base is not a port range"
    adv = doc.get("endpoint_host", "*")
    if isinstance(adv, str) and adv not in _WILDCARDS and adv.strip("[]") != host.strip("[]"):
        log.info("worker %s advertises KV events on %s: dialing the worker's own host %s", w.url, adv, host)
    return Publisher(host, kv, topic, bs, dp, replay_port, load_port, load_topic), None


def address_problem(pub: Publisher, w: Worker, own: Any) -> str | None:
    """Why ``pub``'s ports may not be dialed, or None: the ranges overlap each other or the
    worker's own HTTP port, or one of them is this router's own listener (``own``: the
    registry's OwnAddresses), the checks every address a target can get passes."""
    ranges = [
        (name, base)
        for name, base in (("kv", pub.kv_base), ("replay", pub.replay_base), ("load", pub.load_base))
        if base is not None
    ]
    ports = [(name, base + r) for name, base in ranges for r in range(pub.dp_size)]
    seen: dict[int, str] = {}
    for name, port in ports:
        if port in seen:
            return f"its {seen[port]} and {name} port ranges overlap at {port}"
        if port == w.port:
            return f"its {name} port range includes its own HTTP port {port}"
        seen[port] = name
    ip = w.addr[0] if w.addr else None
    if ip is not None and own is not None:
        for name, port in ports:
            what = own.owner(ip, port)
            if what is not None:
                return f"its {name} port {port} is this router's own listener ({what})"
    return None


def parse_endpoint(spec: str, block_size: int) -> Publisher:
    """``--kv-events-endpoint``: ``tcp://*:BASE`` (host ignored: each worker's own), optionally
    ``,replay=PORT`` and ``,load=PORT`` bases. Raises ValueError naming what is wrong."""
    head, *opts = [p.strip() for p in spec.split(",")]
    if not head.startswith("tcp://") or ":" not in head[6:]:
        raise ValueError(f"--kv-events-endpoint {spec!r}: expected tcp://*:PORT[,replay=PORT][,load=PORT]")
    bases: dict[str, int] = {}
    pairs = [("kv", head.rsplit(":", 1)[1])] + [(o.partition("=")[0], o.partition("=")[2]) for o in opts]
    for name, value in pairs:
        if name not in ("kv", "replay", "load"):
            raise ValueError(f"--kv-events-endpoint {spec!r}: options are replay=PORT and load=PORT")
        if not value.isdigit() or not 1 <= int(value) <= 65535:
            raise ValueError(f"--kv-events-endpoint {spec!r}: {name}={value!r} is not a port")
        bases[name] = int(value)
    return Publisher("", bases["kv"], "", block_size, 1, bases.get("replay"), bases.get("load"))


# ---- one rank's stream ------------------------------------------------------------------------
@dataclass(eq=False)
class RankStream:
    """Counters and liveness of one rank's subscription (read by the metrics)."""

    worker: str
    rank: int
    target: int
    kv_endpoint: str
    replay_endpoint: str | None
    load_endpoint: str | None
    block_size: int
    prefill: bool
    events: int = 0  # events applied
    batches: int = 0
    gaps: int = 0
    replays: int = 0  # gaps filled through the replay socket
    resyncs: int = 0  # gaps not filled, restarts, silences: the index was cleared
    malformed: int = 0  # batches or events that did not decode (skipped)
    skipped: int = 0  # events not indexed (another medium, a LoRA or salted namespace)
    loads: int = 0  # LoadStats applied
    last_event: float = 0.0  # monotonic time of the last batch (0: none yet)
    heard: float = field(default_factory=time.monotonic)  # last message on either socket
    stale: bool = False
    failures: dict[str, int] = field(default_factory=dict)  # reason -> subscription failures
    tasks: list[asyncio.Task] = field(default_factory=list)


class KvEvents:
    """The subscriptions of one process (module docstring)."""

    def __init__(
        self,
        table: TargetTable,
        index: KvIndex | None,
        stale_secs: float,
        configured: Publisher | None = None,
        own: Any = None,
    ) -> None:
        import zmq.asyncio

        self._zmq = zmq
        self._ctx = zmq.asyncio.Context()
        self.table = table
        self.index = index
        self.stale_secs = float(stale_secs)
        self._configured = configured
        self._own = own  # the router's listeners (control/selfaddr.py): never dialed
        self.streams: dict[tuple[str, int], RankStream] = {}
        self._said: set[tuple[str, str]] = set()  # (worker url, reason) logged once
        self._pushed: dict[int, float] = {}  # target row -> monotonic time of its last LoadStat
        self.speed: Any = None  # --speed-aware's SpeedBook: a prefill's busy time per uncached token

    # ---- what the registry has ------------------------------------------------------------------
    def sync(self, workers: list[Worker]) -> None:
        """Subscribe every rank of ``workers`` (the ready ones) that publishes; drop the rest."""
        want: dict[tuple[str, int], tuple[Worker, Publisher]] = {}
        for w in workers:
            pub, why = publisher_of(w, self._configured)
            if pub is not None:
                bad = address_problem(pub, w, self._own)
                if bad is not None:
                    pub, why = None, bad
            if pub is None:
                if w.server_info.get("kv_events") is not None or self._configured is not None:
                    self._say(w.url, f"not subscribing to its KV events: {why}")
                continue
            n = len(w.targets)
            if n != pub.dp_size and not (n == 1 and pub.dp_size == 1):
                if n == 1:
                    self._say(
                        w.url,
                        f"publishes KV events for {pub.dp_size} ranks but is one target: "
                        "they place by rank under --dp-aware only",
                    )
                else:
                    self._say(w.url, f"publishes KV events for {pub.dp_size} ranks but has {n} rank targets")
                continue
            if self.index is None and pub.load_base is None:
                continue  # nothing this process would read
            for i in range(n):
                want[(w.id, i)] = (w, pub)
        for key in [k for k in self.streams if k not in want]:
            self._drop(key)
        for key, (w, pub) in want.items():
            i = key[1]
            rank = w.rank_ids[i] if w.rank_ids and i < len(w.rank_ids) else i
            kv = pub.endpoint(pub.kv_base, rank)
            replay = pub.endpoint(pub.replay_base, rank) if pub.replay_base is not None else None
            load = pub.endpoint(pub.load_base, rank) if pub.load_base is not None else None
            old = self.streams.get(key)
            t = w.targets[i]
            if old is not None and (old.target, old.kv_endpoint, old.load_endpoint, old.block_size) == (
                t,
                kv,
                load,
                pub.block_size,
            ):
                continue
            if old is not None:
                self._drop(key)
            s = RankStream(w.url, rank, t, kv, replay, load, pub.block_size, w.role == "prefill")
            self.streams[key] = s
            loop = asyncio.get_running_loop()
            if self.index is not None:
                self.index.attach(t, pub.block_size)
                s.tasks.append(loop.create_task(self._supervise(s, self._kv_stream, pub.topic), name=f"kv events {kv}"))
            if load is not None:
                s.tasks.append(
                    loop.create_task(self._supervise(s, self._load_stream, pub.load_topic), name=f"loads {load}")
                )
            log.info(
                "subscribed to KV events of %s rank %d at %s%s", w.url, rank, kv, f", loads at {load}" if load else ""
            )

    def _say(self, url: str, what: str) -> None:
        if (url, what) not in self._said:
            self._said.add((url, what))
            log.warning("worker %s %s", url, what)

    def _drop(self, key: tuple[str, int]) -> None:
        s = self.streams.pop(key)
        for task in s.tasks:
            task.cancel()
        if self.index is not None:
            self.index.detach(s.target)
        self._pushed.pop(s.target, None)

    async def stop(self) -> None:
        tasks = [t for s in self.streams.values() for t in s.tasks]
        for key in list(self.streams):
            self._drop(key)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._ctx.destroy(linger=0)

    def pushed(self, t: int) -> bool:
        """True while row ``t`` has a LoadStat newer than PUSH_FRESH_SECS (the poll leaves it)."""
        at = self._pushed.get(t)
        return at is not None and time.monotonic() - at < PUSH_FRESH_SECS

    # ---- supervision ------------------------------------------------------------------------------
    async def _supervise(self, s: RankStream, body: Callable[[RankStream, str], Any], topic: str) -> None:
        delay = 0.1
        failing = False
        while True:
            started = time.monotonic()
            try:
                await body(s, topic)
                cause = "the stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a socket or replay failure: retried, said once
                cause = f"{type(exc).__name__}: {exc}"
                reason = "replay_timeout" if isinstance(exc, TimeoutError) else "socket_error"
                s.failures[reason] = s.failures.get(reason, 0) + 1
                log.debug("KV subscription %s failed", s.kv_endpoint, exc_info=True)
            if not failing:
                log.warning("KV subscription of %s rank %d failed (%s); retrying", s.worker, s.rank, cause)
            failing = True
            if time.monotonic() - started > 10.0:
                delay = 0.1
            await asyncio.sleep(backoff_delay(delay))
            delay = min(delay * 2, 10.0)

    # ---- loads ------------------------------------------------------------------------------------
    async def _load_stream(self, s: RankStream, topic: str) -> None:
        assert s.load_endpoint is not None  # started only for a rank that publishes loads
        zmq = self._zmq
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sock.connect(s.load_endpoint)
            while True:
                frames = await sock.recv_multipart()
                s.heard = time.monotonic()
                load = decode_load(frames[2]) if len(frames) == 3 else None
                if load is None:
                    s.malformed += 1
                    continue
                self._apply_load(s, load)
                if self.speed is not None and s.prefill:
                    counters = prefill_counters(frames[2])
                    if counters is not None:
                        self.speed.prefill_counters(s.target, *counters)
        finally:
            sock.close(linger=0)

    def _apply_load(self, s: RankStream, load: tuple[int, int, int, int, int]) -> None:
        running, waiting, tokens, cap, uncached = load
        t = s.target
        kv_queue = int(self.table.array[t, COL_POLLED_KV_QUEUE])  # the poll's, which LoadStat lacks
        self.table.set_polled(t, running, waiting, tokens, cap, uncached if s.prefill else -1, kv_queue)
        if self.index is not None:
            # Prefill work ahead of a new request: the uncached tokens waiting, and on a PD
            # prefill the KV of the batch being computed (it holds nothing else for long).
            self.index.set_queue(t, uncached + (tokens if s.prefill else 0), max(cap, 0))
        self._pushed[t] = time.monotonic()
        s.loads += 1

    # ---- KV events ----------------------------------------------------------------------------------
    async def _kv_stream(self, s: RankStream, topic: str) -> None:
        zmq = self._zmq
        idx = self.index
        assert idx is not None
        idx.attach(s.target, s.block_size)
        sock = self._ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, RCV_HWM)  # past it ZMQ drops: a gap, replayed
            sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
            sock.connect(s.kv_endpoint)
            last: int | None = None
            catching_up = -1  # after a replay, live batches up to this seq are duplicates
            if s.replay_endpoint is not None:
                first, last = await self._replay(s, 0, None)
                if first in (None, 0):
                    idx.mark_whole(s.target, cold=True)
                catching_up = last if last is not None else -1
            poller = zmq.asyncio.Poller()
            poller.register(sock, zmq.POLLIN)
            while True:
                ready = await poller.poll(timeout=max(self.stale_secs, 0.05) * 1000 / 4)
                now = time.monotonic()
                if not ready:
                    if not s.stale and now - max(s.heard, s.last_event) > self.stale_secs:
                        self._stale(s, f"silent for {self.stale_secs:g} s")
                    continue
                frames = await sock.recv_multipart()
                s.heard = now
                if len(frames) != 3 or len(frames[1]) != 8:
                    s.malformed += 1
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if last is None:
                    if seq == 0 and s.replay_endpoint is None:
                        idx.mark_whole(s.target, cold=True)  # the publisher's very first batch
                elif seq <= last:
                    if seq <= catching_up:
                        continue  # already applied through the replay
                    self._stale(s, f"publisher restarted (seq {seq} after {last})")
                    catching_up = -1
                elif seq > last + 1:
                    s.gaps += 1
                    first, got = await self._replay(s, last + 1, seq - 1) if s.replay_endpoint else (None, None)
                    if first == last + 1 and got is not None and got >= seq - 1:
                        s.replays += 1
                    else:
                        self._stale(s, f"batches {last + 1}..{seq - 1} lost and not replayed")
                if s.stale:
                    s.stale = False
                    idx.mark_whole(s.target)
                await self._apply(s, frames[2])
                last = seq
        finally:
            sock.close(linger=0)

    def _stale(self, s: RankStream, why: str) -> None:
        s.resyncs += 1
        s.stale = True
        if self.index is not None:
            self.index.mark_stale(s.target)
        log.warning(
            "KV index of %s rank %d is stale (%s): placing by the approximate tree until it is whole again",
            s.worker,
            s.rank,
            why,
        )

    async def _replay(self, s: RankStream, start: int, upto: int | None) -> tuple[int | None, int | None]:
        """Ask rank ``s``'s replay socket for the batches from ``start`` (to ``upto``) and
        apply them in order: (first seq received, last seq applied), None where none."""
        assert s.replay_endpoint is not None  # called only for a rank with a replay port
        zmq = self._zmq
        sock = self._ctx.socket(zmq.DEALER)
        first: int | None = None
        last: int | None = None
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(s.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            deadline = time.monotonic() + REPLAY_TIMEOUT
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await sock.poll(timeout=left * 1000):
                    raise TimeoutError(f"replay from {s.replay_endpoint} did not end within {REPLAY_TIMEOUT:g} s")
                frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    s.malformed += 1
                    continue
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == _END:
                    return first, last
                if seq < start or (upto is not None and seq > upto):
                    continue
                if last is not None and seq != last + 1:
                    return first, last  # a hole inside the buffer: replayed only up to it
                if first is None:
                    first = seq
                await self._apply(s, frames[3])
                last = seq
        finally:
            sock.close(linger=0)

    async def _apply(self, s: RankStream, payload: bytes) -> None:
        index = self.index
        assert index is not None
        try:
            batch = _batch_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            s.malformed += 1
            return
        events: list[Any] = []
        size = 0
        for raw in batch.events:
            try:
                ev = _event_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                s.malformed += 1
                continue
            if ev.kind != "cleared" and (
                ev.medium not in (None, "GPU")
                or (ev.kind == "stored" and (ev.lora_id is not None or ev.cache_salt or ev.lora_name))
            ):
                s.skipped += 1
                continue
            for piece in _slices(ev):
                events.append(piece)
                size += len(piece.block_hashes) if piece.kind != "cleared" else 1
                if size >= SLICE_BLOCKS:
                    index.apply(s.target, events)
                    events, size = [], 0
                    await asyncio.sleep(0)
        if events:
            index.apply(s.target, events)
        s.events += len(batch.events)
        s.batches += 1
        s.last_event = time.monotonic()


def _slices(ev: Any) -> list[Any]:
    """An event of more than SLICE_BLOCKS blocks as consecutive events of at most that many (a
    stored piece under the previous piece's last block), so a burst is applied in slices."""
    n = len(ev.block_hashes) if ev.kind != "cleared" else 0
    if n <= SLICE_BLOCKS:
        return [ev]
    out: list[Any] = []
    for a in range(0, n, SLICE_BLOCKS):
        hashes = ev.block_hashes[a : a + SLICE_BLOCKS]
        if ev.kind == "removed":
            out.append(Removed(hashes, ev.medium))
        else:
            bs = ev.block_size
            parent = ev.parent_block_hash if a == 0 else ev.block_hashes[a - 1]
            out.append(Stored(hashes, ev.token_ids[a * bs : (a + SLICE_BLOCKS) * bs], bs, parent))
    return out


class KvEventsCollector:
    """Prometheus families of the subscriptions and the precise picks, read at scrape time."""

    def __init__(self, kv: KvEvents) -> None:
        self.kv = kv

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        labels = ["worker", "dp_rank"]
        counters = {
            name: CounterMetricFamily(f"fastroute_kv_{name}", text, labels=labels)
            for name, text in (
                ("events", "KV events applied to the rank's index"),
                ("event_gaps", "Sequence gaps seen on the rank's KV event stream"),
                ("event_replays", "Gaps filled through the rank's replay socket"),
                ("event_resyncs", "Times the rank's index was cleared (gap not replayed, restart, silence)"),
                ("event_malformed", "KV event batches or events that did not decode (skipped)"),
                ("event_skipped", "KV events not indexed (another medium, a LoRA or salted namespace)"),
                ("loads_pushed", "LoadStats the rank pushed and the router applied"),
            )
        }
        stale = GaugeMetricFamily(
            "fastroute_kv_rank_stale", "1 while the rank's index is not used (stale or warming up)", labels=labels
        )
        blocks = GaugeMetricFamily(
            "fastroute_kv_index_blocks", "Blocks in the rank's precise prefix index", labels=labels
        )
        age = GaugeMetricFamily(
            "fastroute_kv_event_age_seconds", "Seconds since the rank's last KV event batch", labels=labels
        )
        now = time.monotonic()
        index = self.kv.index
        for s in list(self.kv.streams.values()):
            lv = [s.worker, str(s.rank)]
            for name, value in (
                ("events", s.events),
                ("event_gaps", s.gaps),
                ("event_replays", s.replays),
                ("event_resyncs", s.resyncs),
                ("event_malformed", s.malformed),
                ("event_skipped", s.skipped),
                ("loads_pushed", s.loads),
            ):
                counters[name].add_metric(lv, float(value))
            if index is not None:
                stale.add_metric(lv, 0.0 if index.state(s.target) == "fresh" else 1.0)
                blocks.add_metric(lv, float(index.blocks(s.target)))
            if s.last_event:
                age.add_metric(lv, now - s.last_event)
        fails = CounterMetricFamily(
            "smg_kv_event_subscription_failures",
            "KV event or load subscriptions that failed and were retried",
            labels=["worker", "reason"],
        )
        per_worker: dict[tuple[str, str], int] = {}
        for s in list(self.kv.streams.values()):
            for reason, n in s.failures.items():
                per_worker[(s.worker, reason)] = per_worker.get((s.worker, reason), 0) + n
        for (worker, reason), n in sorted(per_worker.items()):
            fails.add_metric([worker, reason], float(n))
        yield from counters.values()
        yield from (stale, blocks, age, fails)
        if index is not None:
            from fastroute.core.kvindex import HIT_BUCKETS

            buckets = []
            acc = 0
            for bound, n in zip([*map(str, HIT_BUCKETS), "+Inf"], index.hit_counts):
                acc += n
                buckets.append((bound, float(acc)))
            hist = HistogramMetricFamily(
                "fastroute_kv_pick_hit_blocks", "Cached prefix blocks of the rank each precise pick chose"
            )
            hist.add_metric([], buckets, float(index.hit_sum))
            yield hist
            fb = CounterMetricFamily(
                "fastroute_kv_pick_fallbacks",
                "cache_aware picks left to the approximate tree, by reason",
                labels=["reason"],
            )
            for reason, n in sorted(index.fallbacks.items()):
                fb.add_metric([reason], float(n))
            yield fb
