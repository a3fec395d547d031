"""The simulated SGLang engines: prefill compute, the DP-attention decode step loop with its per-rank
KV model, and the bootstrap-room rendezvous between them. No HTTP lives here (see ``server``).

Timing model (every duration is multiplied by ``time_scale``):
* decode step: one step serves every rank at once (DP attention) and lasts
  ``step_base_ms + max over ranks (step_request_ms * running_r + step_mtoken_ms * ctx_r / 1e6)``,
  i.e. the busiest rank sets the pace. Defaults are fitted to seed 000's measurements: 27.3 ms
  base, 2.0 ms per running request and 4.0 ms per million context tokens, so one more request
  on the busiest rank costs as much as 0.5M context tokens (the seed reports 0.2M-1M) and a rank
  running 6 / 8 / 9 requests of ~30k context steps in ~40 / ~44 / ~46 ms.
* prefill: each prefill rank computes its requests one at a time (FIFO), for
  ``prefill_base_ms + input_tokens / prefill_tokens_per_s``.

KV model per decode rank (``DecodeEngine``): a request leaves the prealloc queue (FIFO,
head-of-line blocking like SGLang's) once its input plus its output reserve fit in the rank's
``max_total_num_tokens``; its input KV is then allocated and it waits in the transfer queue for
the prefill's KV (optionally through a bandwidth-limited channel, ``--kv-transfer-tokens-per-s``
per server or per rank), then joins the batch. ``num_used_tokens`` reports the tokens actually
allocated (input + generated of admitted requests); ``num_waiting_reqs`` every request not yet
running on the rank; the disaggregation section splits it into ``decode_prealloc_queue_reqs``,
``decode_transfer_queue_reqs`` and ``decode_retracted_queue_reqs``. ``--retract`` reserves only
part of the output and retracts the newest requests when a step would not fit; ``--slow-rank R
--slow-factor F`` makes rank R's share of the step F times costlier (a straggler GPU, which under
DP attention slows every rank). Mixed hardware: ``--speed-factor F`` makes every step and every
prefill compute of the server F times longer, ``--slowdown-at S --slowdown-factor G`` G times
longer again from S wall seconds after the engine started, and ``--prefill-rank-rates`` gives each
prefill rank its own tokens/s.

Rendezvous (bootstrap room): the prefill marks ``bootstrap_room`` ready on its ``Rendezvous``
board when its compute ends. A decode looks the board up by bootstrap port in the in-process
map ``boards`` when prefill and decode run in one process; otherwise it long-polls
``GET /room/<room>`` on ``bootstrap_host:bootstrap_port``, where every simulated prefill runs a
tiny bootstrap listener (the simulated counterpart of SGLang's KV bootstrap server). A decode
request without ``bootstrap_room`` (e.g. a health probe) does not wait.

Rank placement: ``routed_dp_rank``, else ``data_parallel_rank``, else the engine's own DP
controller (``dispatch.DpController``, ``--load-balance-method``): by default (``auto``) a
prefill follows the room (``room % dp_size``) and a decode cycles round robin; with
``total_requests`` / ``total_tokens`` it books each dispatch and refreshes from the load
snapshots the ranks publish (a prefill rank at the start and end of each compute, a decode
every ``load_snapshot_interval`` steps and when idle).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

# The knobs and the parsed request live in params; importers of the engine find them here too.
from fastroute.sim.params import BadRequest, ParsedGen, SimParams
from fastroute.sim.prefixcache import PrefixCache, block_hashes
from fastroute.sim.rendezvous import Rendezvous

__all__ = [
    "BadRequest",
    "DecodeEngine",
    "DecodeReq",
    "ParsedGen",
    "PrefillEngine",
    "Rendezvous",
    "SimParams",
    "block_hashes",
]


# ---------------------------------------------------------------------------------------------
# Helpers


async def _cancelled(task: asyncio.Task | None) -> None:
    """Cancel an engine's background task and wait until it has ended."""
    if task is not None:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


# ---------------------------------------------------------------------------------------------
# Engines


class _PrefillRank:
    __slots__ = (
        "lock",
        "running",
        "waiting",
        "tokens",
        "wait_tokens",
        "wait_uncached",
        "cache",
        "uncached_total",
        "busy_us",
        "input_tokens",
        "hit_tokens",
    )

    def __init__(self, cache: PrefixCache) -> None:
        self.lock = asyncio.Lock()  # FIFO: asyncio.Lock wakes waiters in arrival order
        self.running = 0
        self.waiting = 0
        self.tokens = 0
        self.wait_tokens = 0  # input tokens of the requests queued behind the running one
        self.wait_uncached = 0  # of those, not in the cache when each was queued
        self.cache = cache
        self.uncached_total = 0  # prompt tokens computed (not found in the cache), cumulative
        self.busy_us = 0  # wall microseconds spent computing, cumulative
        self.input_tokens = 0  # prompt tokens of started prefills, and of those the cached ones
        self.hit_tokens = 0  # (the rank's cache_hit_rate in /v1/loads)


class PrefillEngine:
    """Per-rank FIFO compute; publishes each finished room on ``board``.

    With ``prefix_cache_tokens`` each rank keeps its own LRU cache of prompt blocks (each DP
    rank has its own radix cache in SGLang): the leading blocks of a prompt found there are not
    computed again, so a hit shortens the prefill; ``hit_tokens / input_tokens`` is the hit rate.
    The cache (``prefixcache.PrefixCache``) is matched and filled when a compute starts; with KV
    events its sink publishes what it stores and evicts, and ``on_change`` hears every change of
    a rank's load (queued, started, finished, aborted) for the rank's LoadStat (``load_stat``:
    the uncached tokens of a queued request are its miss against the cache when it was queued).

    ``start`` runs a sampler: every ``sample_interval_s`` it appends ``(t_wall, outstanding,
    tokens)`` to ``samples``, per rank the requests running or queued and their input tokens."""

    def __init__(self, params: SimParams, board: Rendezvous) -> None:
        self.p = params
        self.board = board
        cap = params.prefix_cache_tokens // params.prefix_block_tokens
        self.ranks = [_PrefillRank(PrefixCache(cap, params.prefix_block_tokens)) for _ in range(params.dp_size)]
        self.on_change: Callable[[int], None] | None = None  # a rank's load changed (KV events' LoadStat)
        self.ctl = params.controller("prefill")
        self.completed = 0
        self.aborted = 0
        self.input_tokens = 0  # prompt tokens of started prefills (prefix cache statistics)
        self.hit_tokens = 0  # of those, found in the rank's prefix cache
        self.samples: deque = deque(maxlen=200_000)
        self._task: asyncio.Task | None = None
        self._t0 = time.monotonic()  # when it started (--slowdown-at counts from here)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._sampler())

    async def stop(self) -> None:
        await _cancelled(self._task)
        self._task = None

    async def _sampler(self) -> None:
        while True:
            rks = self.ranks
            self.samples.append(
                (time.time(), tuple(r.running + r.waiting for r in rks), tuple(r.tokens + r.wait_tokens for r in rks))
            )
            await asyncio.sleep(self.p.sample_interval_s)

    def _publish(self, i: int) -> None:
        r = self.ranks[i]
        self.ctl.publish(i, r.running + r.waiting, r.tokens + r.wait_tokens)
        if self.on_change is not None:
            self.on_change(i)

    def _uncached(self, r: _PrefillRank, g: ParsedGen) -> int:
        """Tokens of g's prompt not in rank r's cache now (a lookup only)."""
        if not g.blocks or self.p.prefix_cache_tokens <= 0:
            return g.input_tokens
        return max(0, g.input_tokens - r.cache.match(g.blocks) * self.p.prefix_block_tokens)

    def _cached_tokens(self, r: _PrefillRank, g: ParsedGen) -> int:
        """Tokens of g's prompt already in rank r's cache; caches g's blocks (LRU)."""
        if not g.blocks or self.p.prefix_cache_tokens <= 0:
            return 0
        hit = r.cache.insert(g.blocks, g.token_ids)
        return min(g.input_tokens, hit * self.p.prefix_block_tokens)

    def load_stat(self, i: int) -> tuple:
        """Rank i's LoadStat fields (``kvevents.KvEventsHub``), without the rank."""
        r, p = self.ranks[i], self.p
        return (
            r.running,
            r.waiting,
            r.tokens,
            p.max_total_num_tokens,
            r.wait_uncached,
            r.tokens + r.wait_tokens,
            p.max_running_requests,
            r.uncached_total,
            r.busy_us,
        )

    def rank_for(self, g: ParsedGen) -> int:
        return self.place([g])[0]

    def place(self, items: list[ParsedGen]) -> list[int]:
        """Ranks of a request's items: the body's rank, else the DP controller's choice; under
        ``cache_oracle`` (a benchmark's bound) always the rank of least queued + running +
        uncached tokens for it, knowing every rank's cache (fewest requests on a tie)."""
        if self.ctl.method == "cache_oracle":
            out = []
            for it in items:
                cost = [(r.wait_uncached + r.tokens + self._uncached(r, it), r.running + r.waiting) for r in self.ranks]
                out.append(cost.index(min(cost)))
            return out
        for it in items:
            if it.rank is not None and not 0 <= it.rank < self.p.dp_size:
                raise BadRequest(f"dp rank {it.rank} out of range [0, {self.p.dp_size})")
        return self.ctl.pick_many([(it.rank, it.room, it.input_tokens) for it in items])

    async def run(self, g: ParsedGen, rank: int) -> None:
        r = self.ranks[rank]
        queued = True
        # What it adds to the rank's queued uncached tokens: its miss as of now (SGLang matches
        # a waiting request against the tree once and reports that).
        unc = self._uncached(r, g)
        r.waiting += 1
        r.wait_tokens += g.input_tokens
        r.wait_uncached += unc
        if r.lock.locked():
            self._publish(rank)  # queued behind the running one
        try:
            async with r.lock:
                queued = False
                r.waiting -= 1
                r.wait_tokens -= g.input_tokens
                r.wait_uncached -= unc
                # The cache is looked up when the compute starts, as a scheduler matches the
                # radix tree when it schedules the request.
                cached = self._cached_tokens(r, g)
                self.input_tokens += g.input_tokens
                self.hit_tokens += cached
                r.input_tokens += g.input_tokens
                r.hit_tokens += cached
                slow = self.p.slowness(time.monotonic() - self._t0)
                dur = (
                    self.p.time_scale
                    * slow
                    * (self.p.prefill_base_ms / 1000.0 + (g.input_tokens - cached) / self.p.prefill_rate(rank))
                )
                r.running += 1
                r.tokens += g.input_tokens
                self._publish(rank)  # the scheduler formed its batch
                t0 = time.monotonic()
                try:
                    await asyncio.sleep(dur)
                finally:
                    r.running -= 1
                    r.tokens -= g.input_tokens
                    r.uncached_total += g.input_tokens - cached
                    r.busy_us += int((time.monotonic() - t0) * 1e6)
                    self._publish(rank)  # the batch's result
        except asyncio.CancelledError:
            # Client gone: leave the queue (or the compute) without publishing the room.
            if queued:
                r.waiting -= 1
                r.wait_tokens -= g.input_tokens
                r.wait_uncached -= unc
                self._publish(rank)
            self.aborted += 1
            raise
        if g.room is not None:
            self.board.mark_ready(g.room, rank)
        self.completed += 1

    def rank_loads(self) -> list[tuple[int, int, int]]:
        """(running, waiting, tokens) per rank."""
        return [(r.running, r.waiting, r.tokens) for r in self.ranks]

    def waiting_uncached(self, rank: int) -> int:
        """SGLang's estimate of the uncached tokens waiting on a rank (its fallback when the
        queue is not prefix-matched yet): the queued input tokens times the miss rate so far."""
        miss = 1.0 - (self.hit_tokens / self.input_tokens if self.input_tokens else 0.0)
        return int(self.ranks[rank].wait_tokens * miss)


class DecodeReq:
    """One request inside the decode engine.

    ``state``: prealloc -> transfer -> ready -> running -> done, and with ``retract`` also
    running -> retracted -> ready. ``r_out`` is the output KV the engine holds back for it at
    admission (all of ``max_new`` unless the engine over-commits under ``retract``)."""

    __slots__ = (
        "rid",
        "rank",
        "input_tokens",
        "max_new",
        "generated",
        "state",
        "emit",
        "done",
        "reserve",
        "kv_in",
        "r_out",
        "xfer",
    )

    def __init__(self, rid: str, rank: int, input_tokens: int, max_new: int, emit: Any, done: asyncio.Future) -> None:
        self.rid = rid
        self.rank = rank
        self.input_tokens = input_tokens
        self.max_new = max_new
        self.generated = 0
        self.state = "prealloc"
        self.emit = emit  # callable(req) per token, or None
        self.done = done
        self.reserve = input_tokens + max_new  # KV it needs to finish
        self.kv_in = False  # the prefill's KV is ready to send (room ready)
        self.r_out = max_new
        self.xfer: asyncio.TimerHandle | None = None  # pending end of its KV transfer


class _DecodeRank:
    """Queues and KV counters of one decode DP rank.

    Invariants: ``used`` = sum of input + generated over requests in transfer, ready, running
    (the tokens allocated in the pool: SGLang's num_used_tokens); ``held`` = sum over the same
    requests of the output reserve they have not generated into yet; admission keeps
    ``used + held <= capacity`` and only decoding past the reserve (``retract``) can break it,
    which retraction then repairs."""

    __slots__ = (
        "prealloc",
        "transfer",
        "ready",
        "running",
        "retracted",
        "used",
        "held",
        "ctx",
        "xfer_free_at",
        "step_factor",
    )

    def __init__(self, step_factor: float = 1.0) -> None:
        self.prealloc: deque[DecodeReq] = deque()
        self.transfer: set[DecodeReq] = set()  # KV allocated, waiting for the room or the transfer
        self.ready: deque[DecodeReq] = deque()
        self.running: list[DecodeReq] = []
        self.retracted: deque[DecodeReq] = deque()
        self.used = 0
        self.held = 0
        self.ctx = 0  # context tokens of running requests (what a step reads)
        self.xfer_free_at = 0.0  # loop time the rank's transfer channel is free (scope "rank")
        self.step_factor = step_factor

    def waiting(self) -> int:
        return len(self.prealloc) + len(self.transfer) + len(self.ready) + len(self.retracted)


class DecodeEngine:
    """DP-attention decode: one step loop for all ranks, paced by the busiest rank.

    KV model per rank (``_DecodeRank``): a request waits in the prealloc queue (FIFO, head of
    line blocks like SGLang's) until ``input + r_out`` fits next to what the rank holds; then its
    input is allocated and it waits in the transfer queue for the prefill's KV: the room, then,
    with ``kv_transfer_tokens_per_s``, its transfer through the rank's (or the server's) one
    channel, FIFO. Without ``retract`` the reserve is the whole output, so a running request
    never runs out; with it only ``min(max_new, reserved_decode_tokens)`` is held back, and when
    the next step would not fit, the newest running requests are retracted (their KV freed)
    into the retracted queue, which is re-admitted before the prealloc queue once the rank has
    room for them plus one step of its batch.

    Samples per-rank (running, outstanding, KV used, prealloc) every ``sample_interval_s`` into
    ``samples`` as ``(t_wall, step_ms, running, outstanding, used, prealloc)`` tuples."""

    def __init__(self, params: SimParams) -> None:
        self.p = params
        self.ranks = [_DecodeRank(params.slow_factor if i == params.slow_rank else 1.0) for i in range(params.dp_size)]
        self.ctl = params.controller("decode")
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop_ref: asyncio.AbstractEventLoop | None = None
        self.samples: deque = deque(maxlen=200_000)
        self._last_sample = 0.0
        self.completed = 0
        self.aborted = 0
        self.retractions = 0
        self.steps = 0
        self.tokens_out = 0
        self.last_step_ms = 0.0
        self.placed = [0] * params.dp_size
        self.xfer_free_at = 0.0  # the server's transfer channel (scope "server")
        self._t0 = time.monotonic()  # when it started (--slowdown-at counts from here)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()
        self._loop_ref = asyncio.get_running_loop()
        self._task = self._loop_ref.create_task(self._loop())

    async def stop(self) -> None:
        await _cancelled(self._task)
        self._task = None
        for rk in self.ranks:
            for req in rk.transfer:
                if req.xfer is not None:
                    req.xfer.cancel()
                    req.xfer = None

    def pick_rank(self, rank: int | None, input_tokens: int = 0) -> int:
        return self.place([(rank, None, input_tokens)])[0]

    def place(self, items: list[tuple[int | None, int | None, int]]) -> list[int]:
        """Ranks of a request's items ``(rank, room, input_tokens)``: the body's rank, else the
        DP controller's choice."""
        for rank, _, _ in items:
            if rank is not None and not 0 <= rank < self.p.dp_size:
                raise BadRequest(f"dp rank {rank} out of range [0, {self.p.dp_size})")
        return self.ctl.pick_many(items)

    def _publish_all(self) -> None:
        """Every rank publishes its snapshot: running + waiting requests, and KV allocated plus
        the tokens of requests not yet holding KV (SGLang's num_total_tokens)."""
        ctl = self.ctl
        for i, r in enumerate(self.ranks):
            pending = sum(q.input_tokens + q.generated for q in r.prealloc) + sum(
                q.input_tokens + q.generated for q in r.retracted
            )
            ctl.publish(i, len(r.running) + r.waiting(), r.used + pending)

    def submit(self, req: DecodeReq) -> None:
        if req.reserve > self.p.max_total_num_tokens:
            raise BadRequest(f"request needs {req.reserve} KV tokens, rank capacity is {self.p.max_total_num_tokens}")
        if self.p.retract:
            req.r_out = min(req.max_new, max(0, self.p.reserved_decode_tokens))
        self.placed[req.rank] += 1
        self.ranks[req.rank].prealloc.append(req)
        self._admit(self.ranks[req.rank])

    def load_stat(self, i: int, regular: bool = False) -> tuple:
        """Rank i's LoadStat fields (``kvevents.KvEventsHub``), without the rank. Nothing waits
        for prefill compute on a decode; on a ``regular`` server the prompts not yet running do."""
        rk, p = self.ranks[i], self.p
        pending = sum(q.input_tokens + q.generated for q in rk.prealloc)
        pending += sum(q.input_tokens + q.generated for q in rk.retracted)
        unc = sum(q.input_tokens for q in rk.prealloc) + sum(q.input_tokens for q in rk.ready) if regular else 0
        cap = p.max_total_num_tokens
        return (len(rk.running), rk.waiting(), rk.used, cap, unc, rk.used + pending, p.max_running_requests, 0, 0)

    def free_kv(self, rank: int) -> int:
        """The rank's true free KV (capacity - allocated), what a router estimates from polls."""
        return self.p.max_total_num_tokens - self.ranks[rank].used

    def _admit(self, rk: _DecodeRank) -> None:
        cap = self.p.max_total_num_tokens
        # Retracted requests first (SGLang resumes them before new ones), each with room for
        # itself plus one more step of the rank's batch, so a request retracted because the
        # step did not fit is not re-admitted by the same shortage (no thrash).
        while rk.retracted:
            req = rk.retracted[0]
            size = req.input_tokens + req.generated
            rem = req.r_out - req.generated if req.r_out > req.generated else 0
            if rk.used + rk.held + size + rem + len(rk.running) + len(rk.ready) + 1 > cap:
                return  # head of line: nothing new is admitted past a retracted request
            rk.retracted.popleft()
            rk.used += size
            rk.held += rem
            self._to_ready(rk, req)
        while rk.prealloc and rk.used + rk.held + rk.prealloc[0].input_tokens + rk.prealloc[0].r_out <= cap:
            req = rk.prealloc.popleft()
            rk.used += req.input_tokens
            rk.held += req.r_out
            req.state = "transfer"
            rk.transfer.add(req)
            if req.kv_in:  # its room was ready while it queued for KV: the transfer starts now
                self._start_transfer(rk, req)

    def _to_ready(self, rk: _DecodeRank, req: DecodeReq) -> None:
        req.state = "ready"
        rk.ready.append(req)
        if self._wake is not None:
            self._wake.set()

    def _start_transfer(self, rk: _DecodeRank, req: DecodeReq) -> None:
        rate = self.p.kv_transfer_tokens_per_s
        if rate <= 0 or self._loop_ref is None:
            rk.transfer.discard(req)
            self._to_ready(rk, req)
            return
        # One FIFO channel per rank (or per server): a transfer starts when the previous one
        # on the channel ends and lasts input / rate. An aborted transfer keeps its slot.
        now = self._loop_ref.time()
        dur = req.input_tokens / rate * self.p.time_scale
        if self.p.kv_transfer_scope == "rank":
            end = rk.xfer_free_at = max(now, rk.xfer_free_at) + dur
        else:
            end = self.xfer_free_at = max(now, self.xfer_free_at) + dur
        req.xfer = self._loop_ref.call_at(end, self._transfer_done, req)

    def _transfer_done(self, req: DecodeReq) -> None:
        req.xfer = None
        if req.state != "transfer":
            return
        rk = self.ranks[req.rank]
        rk.transfer.discard(req)
        self._to_ready(rk, req)

    def kv_arrived(self, req: DecodeReq) -> None:
        """The prefill's KV for ``req`` is ready to send: its transfer starts once it has KV here."""
        req.kv_in = True
        if req.state == "transfer" and req.xfer is None:
            self._start_transfer(self.ranks[req.rank], req)
        # still in prealloc: _admit starts the transfer once KV is allocated

    def _free(self, rk: _DecodeRank, req: DecodeReq) -> None:
        rk.used -= req.input_tokens + req.generated
        if req.r_out > req.generated:
            rk.held -= req.r_out - req.generated

    def abort(self, req: DecodeReq) -> None:
        """Remove ``req`` wherever it is and free its KV (client gone, rendezvous failed)."""
        rk = self.ranks[req.rank]
        st = req.state
        if st == "done":
            return
        req.state = "done"
        self.aborted += 1
        if st == "prealloc" or st == "retracted":
            q = rk.prealloc if st == "prealloc" else rk.retracted
            try:
                q.remove(req)
            except ValueError:
                pass
            if st == "prealloc":
                return  # held no KV
            self._admit(rk)  # a retracted head may have blocked the queue
            return
        if st == "transfer":
            rk.transfer.discard(req)
            if req.xfer is not None:
                req.xfer.cancel()
                req.xfer = None
        elif st == "ready":
            try:
                rk.ready.remove(req)
            except ValueError:
                pass
        elif st == "running":
            rk.running.remove(req)
            rk.ctx -= req.input_tokens + req.generated
        self._free(rk, req)
        self._admit(rk)

    def _retract(self, rk: _DecodeRank, cap: int) -> None:
        """Retract the newest running requests until one more token each fits (SGLang retracts
        rather than fail a step when decoding outgrows the pool)."""
        while rk.running and rk.used + len(rk.running) > cap:
            req = rk.running.pop()
            rk.ctx -= req.input_tokens + req.generated
            self._free(rk, req)
            req.state = "retracted"
            rk.retracted.append(req)
            self.retractions += 1

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        p = self.p
        cap = p.max_total_num_tokens
        assert self._wake is not None
        # Steps run back to back on a deadline: a step that starts late (the host
        # was busy) is shortened by the lateness, so the modelled step time, not
        # the event loop's scheduling delay, sets the pace. If the loop falls more
        # than one step behind, the schedule restarts from now rather than
        # bursting to catch up; after an idle spell it restarts too.
        step_end = 0.0
        while True:
            # Requests whose KV arrived join now, up to max_running_requests per rank.
            busy = False
            cost = 0.0
            for rk in self.ranks:
                while rk.ready and len(rk.running) < p.max_running_requests:
                    req = rk.ready.popleft()
                    req.state = "running"
                    rk.running.append(req)
                    rk.ctx += req.input_tokens + req.generated
                if p.retract and rk.used + len(rk.running) > cap:
                    self._retract(rk, cap)
                if rk.running:
                    busy = True
                    c = (p.step_request_ms * len(rk.running) + p.step_mtoken_ms * rk.ctx / 1e6) * rk.step_factor
                    if c > cost:
                        cost = c
            if not busy:
                self._sample(loop.time(), 0.0)
                if self.ctl.load_aware:
                    self._publish_all()  # an idle scheduler publishes at once
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), p.sample_interval_s)
                except asyncio.TimeoutError:
                    pass
                continue
            step_ms = (p.step_base_ms + cost) * p.slowness(time.monotonic() - self._t0)
            step_s = step_ms * p.time_scale / 1000.0
            now = loop.time()
            if now - step_end > step_s:
                step_end = now  # idle, or behind by more than a step: restart
            step_end += step_s
            await asyncio.sleep(max(0.0, step_end - loop.time()))
            self.steps += 1
            self.last_step_ms = step_ms
            for rk in self.ranks:
                if not rk.running:
                    continue
                finished = False
                n = len(rk.running)
                for req in rk.running:
                    req.generated += 1
                    if req.generated <= req.r_out:
                        rk.held -= 1  # this token was reserved: held -> used
                    if req.emit is not None:
                        req.emit(req)
                    if req.generated >= req.max_new:
                        finished = True
                rk.ctx += n
                rk.used += n
                self.tokens_out += n
                if finished:
                    keep = []
                    for req in rk.running:
                        if req.generated >= req.max_new:
                            req.state = "done"
                            rk.ctx -= req.input_tokens + req.generated
                            self._free(rk, req)
                            self.completed += 1
                            if not req.done.done():
                                req.done.set_result(True)
                        else:
                            keep.append(req)
                    rk.running = keep
                    self._admit(rk)
            if self.ctl.load_aware and self.steps % max(1, p.load_snapshot_interval) == 0:
                self._publish_all()  # the step's result, every load_snapshot_interval steps
            now = loop.time()
            if now - self._last_sample >= p.sample_interval_s:
                # The modelled step time (what the balance decides), not the wall time, which
                # also carries this process's scheduling overhead.
                self._sample(now, step_ms)

    def _sample(self, now: float, step_ms: float) -> None:
        self._last_sample = now
        rks = self.ranks
        self.samples.append(
            (
                time.time(),
                step_ms,
                tuple(len(r.running) for r in rks),
                tuple(len(r.running) + r.waiting() for r in rks),
                tuple(r.used for r in rks),
                tuple(len(r.prealloc) for r in rks),
            )
        )

    def rank_loads(self) -> list[tuple[int, int, int]]:
        """(running, waiting, used tokens) per rank; waiting = every queue before the batch."""
        return [(len(r.running), r.waiting(), r.used) for r in self.ranks]

    def rank_queues(self, rank: int) -> tuple[int, int, int, int]:
        """(prealloc, transfer, ready, retracted) of one rank."""
        r = self.ranks[rank]
        return len(r.prealloc), len(r.transfer), len(r.ready), len(r.retracted)
