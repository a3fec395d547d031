"""Simulated SGLang prefill/decode servers with DP attention, speaking SGLang's HTTP protocol.

Owns the simulated engines (a prefill that computes for a time proportional to the input and
then publishes its bootstrap room; a decode that waits for that room, places the request on a
DP rank and generates one token per step), their HTTP surface (protocol.md sections 2, 3.3,
3.6, 4, 5.1, 5.2, 6 as seen from a worker), per-rank load sampling for the balance benchmark,
and a CLI / in-process API to run them.

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
DP attention slows every rank).

Rendezvous (bootstrap room): the prefill marks ``bootstrap_room`` ready on its ``Rendezvous``
board when its compute ends. A decode looks the board up by bootstrap port in the in-process
map ``boards`` when prefill and decode run in one process; otherwise it long-polls
``GET /room/<room>`` on ``bootstrap_host:bootstrap_port``, where every simulated prefill runs a
tiny bootstrap listener (the simulated counterpart of SGLang's KV bootstrap server). A decode
request without ``bootstrap_room`` (e.g. a health probe) does not wait.

Rank placement: ``routed_dp_rank``, else ``data_parallel_rank``, else round-robin (SGLang's
default on a decode). Prefill ranks follow the room (``room % dp_size``) unless
``routed_dp_rank`` is given. Streaming ``/generate`` events carry the new token only
(incremental), not SGLang's cumulative text, so a long stream stays O(tokens) bytes.
A client that closes its connection aborts its request and frees its slot and KV.

Batches (protocol.md 3.3: ``input_ids`` list of lists, ``text`` list, ``prompt`` list, chat
``n > 1``) run as one request per item, each with its own room (a list, or a scalar room
expanded to room, room+1, ... as SGLang does) and rank; ``/generate`` answers a JSON list, the
OpenAI paths one body with a choice per item; stream events carry the item's index. If any
item's room never arrives the whole batch fails (500) and every item is freed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from fastroute.dataplane import body as _router_body
from fastroute.sim.http import CT_TEXT, HttpError, HttpServer, Request, Responder, fetch

INFERENCE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues")
SIM_VERSION = "0.5.0-sim"


@dataclass
class SimParams:
    """Knobs of one simulated server; every field is a ``--flag`` of the worker CLI."""

    dp_size: int = 8
    model: str = "sim-model"
    max_total_num_tokens: int = 1_500_000  # per rank
    max_running_requests: int = 256  # per rank
    max_new_tokens: int = 128  # default when the request names none
    step_base_ms: float = 27.3
    step_request_ms: float = 2.0
    step_mtoken_ms: float = 4.0
    prefill_base_ms: float = 20.0
    prefill_tokens_per_s: float = 120_000.0  # per prefill rank
    chars_per_token: float = 4.0  # text -> token estimate (utf-8 bytes per token)
    time_scale: float = 1.0
    sample_interval_s: float = 0.1
    rendezvous_timeout_s: float = 120.0
    # decode KV model (see DecodeEngine)
    retract: bool = False  # over-commit output KV and retract when decoding runs out
    reserved_decode_tokens: int = 128  # output KV held back per request under --retract
    kv_transfer_tokens_per_s: float = 0.0  # prefill -> decode KV bandwidth; 0 = instant
    kv_transfer_scope: str = "server"  # one transfer channel per "server" or per "rank"
    slow_rank: int = -1  # this decode rank steps slow_factor times slower (-1: none)
    slow_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kv_transfer_scope not in ("server", "rank"):
            raise ValueError(f"kv_transfer_scope must be server or rank, not {self.kv_transfer_scope!r}")
        if self.slow_factor <= 0:
            raise ValueError("slow_factor must be positive")

    def step_seconds(self, running: int, ctx_tokens: int) -> float:
        """Step time of one rank alone; the engine takes the max over ranks plus the base."""
        return self.step_request_ms * running + self.step_mtoken_ms * ctx_tokens / 1e6


def estimate_text_tokens(text: str, chars_per_token: float = 4.0) -> int:
    """Token count the simulator assumes for ``text`` (no tokenizer): the router's own estimate
    (``body.estimate_tokens``, ceil(utf-8 bytes / 4)), so both sides agree on what a text request
    weighs; another ``chars_per_token`` scales the same byte count."""
    if chars_per_token == 4.0:
        return _router_body.estimate_tokens(text)
    n = len(text.encode("utf-8", "surrogatepass"))
    return math.ceil(n / chars_per_token) if n else 0


class BadRequest(Exception):
    pass


def _int_field(obj: dict, name: str) -> Optional[int]:
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer")
    return v


@dataclass
class ParsedGen:
    """What the simulator needs from one inference body."""

    kind: str  # "generate" | "completions" | "chat"
    stream: bool
    input_tokens: int
    max_new: int
    room: Optional[int]
    bootstrap_host: Optional[str]
    bootstrap_port: Optional[int]
    rank: Optional[int]
    return_logprob: bool
    include_usage: bool
    model: str
    index: int = 0  # position inside a batch
    batch: Optional[int] = None  # None = scalar request, B = batch of B (protocol.md 3.3)
    items: list = field(default_factory=list)  # one scalar ParsedGen per batch item ([self] if scalar)


def _per_item(obj: dict, name: str, b: int, check: Any) -> list:
    """A scalar or a per-item list field of a batch, as ``b`` values (checked by ``check``)."""
    v = obj.get(name)
    if isinstance(v, list):
        if len(v) != b:
            raise BadRequest(f"{name} has {len(v)} entries for a batch of {b}")
        return [check(x, name) for x in v]
    return [check(v, name)] * b


def _chk_int(v: Any, name: str) -> Optional[int]:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise BadRequest(f"{name} must be an integer")
    return v


def _chk_str(v: Any, name: str) -> Optional[str]:
    return v if isinstance(v, str) else None


def _chk_max_new(v: Any, default: int) -> int:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise BadRequest("max_new_tokens must be a positive integer")
    return v


def parse_inference(path: str, body: bytes, params: SimParams) -> ParsedGen:
    try:
        obj = json.loads(body) if body else {}
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest("body must be a JSON object")
    cpt = params.chars_per_token
    per_item: Optional[list[int]] = None  # input tokens per item when the body is a batch
    item_max_new: Optional[list[int]] = None
    if path == "/generate":
        kind = "generate"
        ids = obj.get("input_ids")
        text = obj.get("text")
        if isinstance(ids, list):
            if ids and isinstance(ids[0], list):
                per_item = [len(x) if isinstance(x, list) else _bad_item("input_ids") for x in ids]
            n_in = len(ids)
        elif isinstance(text, str):
            n_in = estimate_text_tokens(text, cpt)
        elif isinstance(text, list):
            per_item = [estimate_text_tokens(t, cpt) if isinstance(t, str) else _bad_item("text") for t in text]
        else:
            raise BadRequest("either text or input_ids should be provided")
        sp = obj.get("sampling_params") or {}
        if isinstance(sp, list) and per_item is not None and len(sp) == len(per_item):
            item_max_new = [_chk_max_new(x.get("max_new_tokens") if isinstance(x, dict) else None,
                                         params.max_new_tokens) for x in sp]
        elif not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = sp.get("max_new_tokens") if isinstance(sp, dict) else None
    elif path == "/v1/completions":
        kind = "completions"
        prompt = obj.get("prompt")
        if isinstance(prompt, str):
            n_in = estimate_text_tokens(prompt, cpt)
        elif isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            n_in = len(prompt)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            per_item = [estimate_text_tokens(t, cpt) if isinstance(t, str) else _bad_item("prompt") for t in prompt]
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            per_item = [len(x) if isinstance(x, list) else _bad_item("prompt") for x in prompt]
        else:
            raise BadRequest("prompt must be a string or a list of token ids")
        max_new = obj.get("max_tokens")
    else:
        kind = "chat"
        msgs = obj.get("messages")
        if not isinstance(msgs, list):
            raise BadRequest("messages must be a list")
        n_in = _router_body._CHAT_TOKENS_PER_MESSAGE * len(msgs)  # as the router estimates it
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                n_in += estimate_text_tokens(c, cpt)
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        n_in += estimate_text_tokens(part["text"], cpt)
        max_new = obj.get("max_completion_tokens", obj.get("max_tokens"))
        n = obj.get("n")
        per_item = [n_in] * n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None
    max_new = _chk_max_new(max_new, params.max_new_tokens)
    so = obj.get("stream_options")
    stream = bool(obj.get("stream", False))
    return_logprob = bool(obj.get("return_logprob", False))
    include_usage = isinstance(so, dict) and bool(so.get("include_usage"))
    model = obj.get("model") if isinstance(obj.get("model"), str) else params.model
    if per_item is not None:
        return _parse_batch(obj, kind, per_item, item_max_new or [max_new] * len(per_item),
                            stream, return_logprob, include_usage, model)
    room = _int_field(obj, "bootstrap_room")
    port = obj.get("bootstrap_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise BadRequest("bootstrap_port must be an integer or null")
    host = obj.get("bootstrap_host")
    rank = _int_field(obj, "routed_dp_rank")
    if rank is None:
        rank = _int_field(obj, "data_parallel_rank")
    g = ParsedGen(kind, stream, n_in, max_new, room, host if isinstance(host, str) else None, port, rank,
                  return_logprob, include_usage, model)
    g.items = [g]
    return g


def _bad_item(name: str) -> int:
    raise BadRequest(f"{name}: every batch item must have the same type")


def _parse_batch(obj: dict, kind: str, per_item: list[int], max_new: list[int], stream: bool,
                 return_logprob: bool, include_usage: bool, model: str) -> ParsedGen:
    """A batch of B (protocol.md 3.3): bootstrap keys and rank keys may be scalars or lists of B.

    A scalar room is expanded to room, room+1, ... like SGLang does for parallel sampling."""
    b = len(per_item)
    if b == 0:
        raise BadRequest("empty batch")
    rooms = _per_item(obj, "bootstrap_room", b, _chk_int)
    if rooms and not isinstance(obj.get("bootstrap_room"), list) and rooms[0] is not None:
        rooms = [rooms[0] + i for i in range(b)]
    ports = _per_item(obj, "bootstrap_port", b, _chk_int)
    hosts = _per_item(obj, "bootstrap_host", b, _chk_str)
    ranks = _per_item(obj, "routed_dp_rank", b, _chk_int)
    if all(r is None for r in ranks):
        ranks = _per_item(obj, "data_parallel_rank", b, _chk_int)
    items = [ParsedGen(kind, stream, per_item[i], max_new[i], rooms[i], hosts[i], ports[i], ranks[i],
                       return_logprob, include_usage, model, i) for i in range(b)]
    g = ParsedGen(kind, stream, sum(per_item), max(max_new), rooms[0], hosts[0], ports[0], ranks[0],
                  return_logprob, include_usage, model, 0, b, items)
    return g


# ---------------------------------------------------------------------------------------------
# Rendezvous


class Rendezvous:
    """Bootstrap rooms a prefill has finished, and decodes waiting for them.

    A room marked ready before its decode arrives is kept for ``ttl_s`` (then forgotten, so an
    aborted decode never leaks it); a waiter is removed when it is satisfied or cancelled."""

    def __init__(self, ttl_s: float = 300.0) -> None:
        self._ready: dict[int, float] = {}
        self._waiters: dict[int, list[asyncio.Future]] = {}
        self._ttl = ttl_s
        self._last_prune = time.monotonic()

    def mark_ready(self, room: int) -> None:
        waiters = self._waiters.pop(room, None)
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(True)
            return
        now = time.monotonic()
        self._ready[room] = now
        if now - self._last_prune > self._ttl:
            self._last_prune = now
            cutoff = now - self._ttl
            for r in [r for r, t in self._ready.items() if t < cutoff]:
                del self._ready[r]

    def is_ready(self, room: int) -> bool:
        return room in self._ready

    async def wait(self, room: int, timeout: float) -> bool:
        """True once the room is ready (consuming it), False on timeout."""
        if self._ready.pop(room, None) is not None:
            return True
        fut = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(room, []).append(fut)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return False
        finally:
            lst = self._waiters.get(room)
            if lst is not None and fut in lst:
                lst.remove(fut)
                if not lst:
                    del self._waiters[room]

    def pending(self) -> int:
        return len(self._ready) + len(self._waiters)


async def _rendezvous_http(host: str, port: int, room: int, timeout: float) -> bool:
    """Long-poll a (possibly remote) simulated prefill's bootstrap listener for ``room``."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        poll = min(left, 30.0)
        try:
            status, _ = await fetch(host, port, "GET", f"/room/{room}?timeout={poll:.3f}", timeout=poll + 5.0)
        except (HttpError, asyncio.TimeoutError):
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        if status == 200:
            return True


# ---------------------------------------------------------------------------------------------
# Engines


class _PrefillRank:
    __slots__ = ("lock", "running", "waiting", "tokens")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()  # FIFO: asyncio.Lock wakes waiters in arrival order
        self.running = 0
        self.waiting = 0
        self.tokens = 0


class PrefillEngine:
    """Per-rank FIFO compute; publishes each finished room on ``board``."""

    def __init__(self, params: SimParams, board: Rendezvous) -> None:
        self.p = params
        self.board = board
        self.ranks = [_PrefillRank() for _ in range(params.dp_size)]
        self.completed = 0
        self.aborted = 0

    def rank_for(self, g: ParsedGen) -> int:
        if g.rank is not None:
            return g.rank
        # SGLang's default on a prefill: follow_bootstrap_room.
        return (g.room or 0) % self.p.dp_size

    async def run(self, g: ParsedGen, rank: int) -> None:
        r = self.ranks[rank]
        dur = self.p.time_scale * (self.p.prefill_base_ms / 1000.0 + g.input_tokens / self.p.prefill_tokens_per_s)
        queued = True
        r.waiting += 1
        try:
            async with r.lock:
                queued = False
                r.waiting -= 1
                r.running += 1
                r.tokens += g.input_tokens
                try:
                    await asyncio.sleep(dur)
                finally:
                    r.running -= 1
                    r.tokens -= g.input_tokens
        except asyncio.CancelledError:
            # Client gone: leave the queue (or the compute) without publishing the room.
            if queued:
                r.waiting -= 1
            self.aborted += 1
            raise
        if g.room is not None:
            self.board.mark_ready(g.room)
        self.completed += 1

    def rank_loads(self) -> list[tuple[int, int, int]]:
        """(running, waiting, tokens) per rank."""
        return [(r.running, r.waiting, r.tokens) for r in self.ranks]


class DecodeReq:
    """One request inside the decode engine.

    ``state``: prealloc -> transfer -> ready -> running -> done, and with ``retract`` also
    running -> retracted -> ready. ``r_out`` is the output KV the engine holds back for it at
    admission (all of ``max_new`` unless the engine over-commits under ``retract``)."""

    __slots__ = ("rid", "rank", "input_tokens", "max_new", "generated", "state", "emit", "done", "reserve",
                 "kv_in", "r_out", "xfer")

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
        self.xfer: Optional[asyncio.TimerHandle] = None  # pending end of its KV transfer


class _DecodeRank:
    """Queues and KV counters of one decode DP rank.

    Invariants: ``used`` = sum of input + generated over requests in transfer, ready, running
    (the tokens allocated in the pool: SGLang's num_used_tokens); ``held`` = sum over the same
    requests of the output reserve they have not generated into yet; admission keeps
    ``used + held <= capacity`` and only decoding past the reserve (``retract``) can break it,
    which retraction then repairs."""

    __slots__ = ("prealloc", "transfer", "ready", "running", "retracted", "used", "held", "ctx", "xfer_free_at",
                 "step_factor")

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
        self.ranks = [_DecodeRank(params.slow_factor if i == params.slow_rank else 1.0)
                      for i in range(params.dp_size)]
        self._rr = 0
        self._wake: Optional[asyncio.Event] = None
        self._task: Optional[asyncio.Task] = None
        self._loop_ref: Optional[asyncio.AbstractEventLoop] = None
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

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._loop_ref = asyncio.get_running_loop()
        self._task = self._loop_ref.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for rk in self.ranks:
            for req in rk.transfer:
                if req.xfer is not None:
                    req.xfer.cancel()
                    req.xfer = None

    def pick_rank(self, rank: Optional[int]) -> int:
        if rank is not None:
            if not 0 <= rank < self.p.dp_size:
                raise BadRequest(f"dp rank {rank} out of range [0, {self.p.dp_size})")
            return rank
        r = self._rr
        self._rr = (r + 1) % self.p.dp_size
        return r

    def submit(self, req: DecodeReq) -> None:
        if req.reserve > self.p.max_total_num_tokens:
            raise BadRequest(f"request needs {req.reserve} KV tokens, rank capacity is {self.p.max_total_num_tokens}")
        if self.p.retract:
            req.r_out = min(req.max_new, max(0, self.p.reserved_decode_tokens))
        self.placed[req.rank] += 1
        self.ranks[req.rank].prealloc.append(req)
        self._admit(self.ranks[req.rank])

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
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), p.sample_interval_s)
                except asyncio.TimeoutError:
                    pass
                continue
            step_ms = p.step_base_ms + cost
            await asyncio.sleep(step_ms * p.time_scale / 1000.0)
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
            now = loop.time()
            if now - self._last_sample >= p.sample_interval_s:
                # The modelled step time (what the balance decides), not the wall time, which
                # also carries this process's scheduling overhead.
                self._sample(now, step_ms)

    def _sample(self, now: float, step_ms: float) -> None:
        self._last_sample = now
        rks = self.ranks
        self.samples.append((time.time(), step_ms,
                             tuple(len(r.running) for r in rks),
                             tuple(len(r.running) + r.waiting() for r in rks),
                             tuple(r.used for r in rks),
                             tuple(len(r.prealloc) for r in rks)))

    def rank_loads(self) -> list[tuple[int, int, int]]:
        """(running, waiting, used tokens) per rank; waiting = every queue before the batch."""
        return [(len(r.running), r.waiting(), r.used) for r in self.ranks]

    def rank_queues(self, rank: int) -> tuple[int, int, int, int]:
        """(prealloc, transfer, ready, retracted) of one rank."""
        r = self.ranks[rank]
        return len(r.prealloc), len(r.transfer), len(r.ready), len(r.retracted)


# ---------------------------------------------------------------------------------------------
# Response bodies


def _now_ts() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "+00:00"


class _Ids:
    """Request ids: cheap, unique per server."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._n = 0

    def next(self) -> str:
        self._n += 1
        return f"{self._prefix}{self._n:x}"


def _finish(n: int) -> dict:
    return {"type": "length", "length": n}


def _generate_body(rid: str, g: ParsedGen, n_out: int, role: str) -> dict:
    meta: dict[str, Any] = {"id": rid, "finish_reason": _finish(n_out), "prompt_tokens": g.input_tokens,
                            "completion_tokens": n_out, "cached_tokens": 0}
    if g.return_logprob:
        if role == "prefill":
            meta["input_token_logprobs"] = [[-1.0, 1, None] for _ in range(g.input_tokens)]
        else:
            meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[-0.5, 1, None] for _ in range(n_out)]
    return {"text": " t" * n_out, "output_ids": [1] * n_out, "meta_info": meta}


def _openai_body(rid: str, g: ParsedGen, outs: list[int]) -> dict:
    """One OpenAI response for all items of ``g`` (choices by index); ``outs`` = tokens per item."""
    n_out = sum(outs)
    # n > 1 samples one prompt: it counts once; a batch of prompts counts each.
    n_in = g.items[0].input_tokens if g.kind == "chat" else g.input_tokens
    usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
    if g.kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": " t" * k},
                    "finish_reason": "length", "logprobs": None} for i, k in enumerate(outs)]
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": g.model,
                "choices": choices, "usage": usage}
    choices = [{"index": i, "text": " t" * k, "finish_reason": "length", "logprobs": None}
               for i, k in enumerate(outs)]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": g.model,
            "choices": choices, "usage": usage}


def _make_emitter(resp: Responder, rid: str, g: ParsedGen) -> Any:
    """Per-token SSE writer for one streaming request; the constant parts are encoded once."""
    if g.kind == "generate":
        head = b'data: {"text":" t","output_ids":[1],"meta_info":{"id":"' + rid.encode() + \
            b'","prompt_tokens":' + str(g.input_tokens).encode() + b',"completion_tokens":'
        last = g.max_new

        tail_mid = b',"finish_reason":null},"index":%d}\n\n' % g.index
        tail_end = b',"finish_reason":{"type":"length","length":%d}},"index":' + b"%d" % g.index + b"}\n\n"

        def emit(req: DecodeReq) -> None:
            n = req.generated
            if n < last:
                resp.write_chunk(head + b"%d" % n + tail_mid)
            else:
                resp.write_chunk(head + b"%d" % n + tail_end % n)
        return emit
    created = int(time.time())
    if g.kind == "chat":
        head = (b'data: {"id":"' + rid.encode() + b'","object":"chat.completion.chunk","created":'
                + str(created).encode() + b',"model":' + json.dumps(g.model).encode()
                + b',"choices":[{"index":%d,"delta":{' % g.index)
        mid_first = b'"role":"assistant","content":" t"},"logprobs":null,"finish_reason":'
        mid = b'"content":" t"},"logprobs":null,"finish_reason":'
    else:
        head = (b'data: {"id":"' + rid.encode() + b'","object":"text_completion","created":'
                + str(created).encode() + b',"model":' + json.dumps(g.model).encode()
                + b',"choices":[{"index":%d,' % g.index)
        mid_first = mid = b'"text":" t","logprobs":null,"finish_reason":'
    last = g.max_new

    def emit_oa(req: DecodeReq) -> None:
        n = req.generated
        fin = b'"length"' if n >= last else b"null"
        resp.write_chunk(head + (mid_first if n == 1 else mid) + fin + b"}]}\n\n")
    return emit_oa


def _usage_event(rid: str, g: ParsedGen, n_out: int) -> bytes:
    n_in = g.items[0].input_tokens if g.kind == "chat" else g.input_tokens
    obj = {"id": rid, "object": "chat.completion.chunk" if g.kind == "chat" else "text_completion",
           "created": int(time.time()), "model": g.model, "choices": [],
           "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


# ---------------------------------------------------------------------------------------------
# The server


class SimWorker:
    """One simulated SGLang server (role prefill | decode | regular) on ``host:port``.

    A prefill also runs its bootstrap listener on ``bootstrap_port`` (0 = ephemeral). ``boards``
    maps bootstrap port -> Rendezvous for prefills in the same process (see module docstring)."""

    def __init__(self, role: str, params: Optional[SimParams] = None, host: str = "127.0.0.1", port: int = 0,
                 bootstrap_port: Optional[int] = None, boards: Optional[dict[int, Rendezvous]] = None) -> None:
        if role not in ("prefill", "decode", "regular"):
            raise ValueError(f"role must be prefill, decode or regular, not {role!r}")
        self.role = role
        self.p = params or SimParams()
        self.host = host
        self.boards = boards if boards is not None else {}
        self.board = Rendezvous()
        self.server = HttpServer(self._app, host, port)
        self.bootstrap_port = bootstrap_port if role == "prefill" else None
        self._boot: Optional[HttpServer] = None
        self.prefill = PrefillEngine(self.p, self.board) if role == "prefill" else None
        self.decode = DecodeEngine(self.p) if role != "prefill" else None
        self._ids = _Ids({"prefill": "p", "decode": "d", "regular": "r"}[role] + "%x-" % (id(self) & 0xffff))
        self.requests = 0
        self.flushes = 0
        self.last_bodies: deque = deque(maxlen=16)  # recent inference bodies, for tests/debugging

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.server.port}"

    async def start(self) -> None:
        await self.server.start()
        if self.role == "prefill":
            self._boot = HttpServer(self._boot_app, self.host, self.bootstrap_port or 0)
            await self._boot.start()
            self.bootstrap_port = self._boot.port
            self.boards[self.bootstrap_port] = self.board
        if self.decode is not None:
            self.decode.start()

    async def stop(self) -> None:
        if self.decode is not None:
            await self.decode.stop()
        await self.server.stop()
        if self._boot is not None:
            await self._boot.stop()
            self.boards.pop(self.bootstrap_port or -1, None)

    # -- bootstrap listener ---------------------------------------------------------------
    async def _boot_app(self, req: Request, resp: Responder) -> None:
        if not req.path.startswith("/room/"):
            resp.send_json(404, {"error": "not found"})
            return
        try:
            room = int(req.path[6:])
            timeout = float(req.query_params().get("timeout", "30"))
        except ValueError:
            resp.send_json(400, {"error": "bad room"})
            return
        ok = await self.board.wait(room, timeout)
        resp.send_json(200 if ok else 404, {"room": room, "ready": ok})

    # -- main app -------------------------------------------------------------------------
    async def _app(self, req: Request, resp: Responder) -> None:
        path = req.path
        if path in INFERENCE_PATHS:
            if req.method != "POST":
                resp.send_json(405, {"detail": "Method Not Allowed"})
                return
            self.requests += 1
            await self._inference(req, resp)
            return
        handler = _ROUTES.get(path)
        if handler is None:
            resp.send_json(404, {"detail": "Not Found"})
            return
        await handler(self, req, resp)

    async def _inference(self, req: Request, resp: Responder) -> None:
        try:
            g = parse_inference(req.path, req.body, self.p)
            if len(self.last_bodies) == self.last_bodies.maxlen:
                self.last_bodies.popleft()
            self.last_bodies.append((req.path, req.body if len(req.body) < 4096 else req.body[:4096]))
            if self.role == "prefill":
                await self._serve_prefill(g, resp)
            else:
                await self._serve_decode(g, resp)
        except BadRequest as exc:
            resp.send_json(400, {"error": {"message": str(exc), "code": 400}, "object": "error",
                                 "message": str(exc), "type": "BadRequestError", "code": 400})

    async def _serve_prefill(self, g: ParsedGen, resp: Responder) -> None:
        eng = self.prefill
        assert eng is not None
        ranks = [eng.rank_for(it) for it in g.items]
        for rank in ranks:
            if not 0 <= rank < self.p.dp_size:
                raise BadRequest(f"dp rank {rank} out of range [0, {self.p.dp_size})")
        rid = self._ids.next()
        if g.batch is None:
            await eng.run(g, ranks[0])
        else:
            # Items compute on their own ranks concurrently; cancelling the gather cancels them all.
            await asyncio.gather(*(eng.run(it, r) for it, r in zip(g.items, ranks)))
        # The prefill returns after its compute with one sampled token, like SGLang's PD prefill.
        if g.kind != "generate":
            body: Any = _openai_body(rid, g, [1] * len(g.items))
        elif g.batch is None:
            body = _generate_body(rid, g, 1, "prefill")
        else:
            body = [_generate_body(f"{rid}.{it.index}", it, 1, "prefill") for it in g.items]
        if g.stream:
            resp.start_stream()
            events = body if isinstance(body, list) else [body]
            resp.write_chunk(b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
                             + b"data: [DONE]\n\n")
            resp.end_stream()
        else:
            resp.send_json(200, body)

    async def _await_kv(self, it: ParsedGen, dreq: DecodeReq) -> bool:
        """Wait for item ``it``'s bootstrap room, then let its request join the batch."""
        if self.role == "decode" and it.room is not None:
            board = self.boards.get(it.bootstrap_port) if it.bootstrap_port is not None else None
            if board is not None:
                ok = await board.wait(it.room, self.p.rendezvous_timeout_s)
            elif it.bootstrap_host and it.bootstrap_port:
                ok = await _rendezvous_http(it.bootstrap_host, it.bootstrap_port, it.room,
                                            self.p.rendezvous_timeout_s)
            else:
                ok = False
            if not ok:
                return False
        assert self.decode is not None
        self.decode.kv_arrived(dreq)
        return True

    async def _serve_decode(self, g: ParsedGen, resp: Responder) -> None:
        eng = self.decode
        assert eng is not None
        loop = asyncio.get_running_loop()
        rid = self._ids.next()
        dreqs: list[DecodeReq] = []
        try:
            for it in g.items:
                irid = rid if g.batch is None else f"{rid}.{it.index}"
                emit = _make_emitter(resp, irid, it) if g.stream else None
                dreq = DecodeReq(irid, eng.pick_rank(it.rank), it.input_tokens, it.max_new, emit,
                                 loop.create_future())
                eng.submit(dreq)
                dreqs.append(dreq)
            if g.stream:
                # Like Starlette's StreamingResponse, the head goes out before any token.
                resp.start_stream()
            if g.batch is None:
                oks = [await self._await_kv(g, dreqs[0])]
            else:
                oks = await asyncio.gather(*(self._await_kv(it, d) for it, d in zip(g.items, dreqs)))
            if not all(oks):
                bad = [it.room for it, ok in zip(g.items, oks) if not ok]
                msg = f"KV transfer for bootstrap_room {bad[0] if len(bad) == 1 else bad} did not arrive"
                if g.stream:
                    err = json.dumps({"error": {"message": msg, "code": 500}}).encode()
                    resp.write_chunk(b"data: " + err + b"\n\ndata: [DONE]\n\n")
                    resp.end_stream()
                else:
                    resp.send_json(500, {"error": {"message": msg, "code": 500}, "object": "error",
                                         "message": msg, "type": "InternalServerError", "code": 500})
                return
            for d in dreqs:
                await d.done
        finally:
            for d in dreqs:
                if d.state != "done":
                    eng.abort(d)
        outs = [d.generated for d in dreqs]
        if g.stream:
            if g.include_usage and g.kind != "generate":
                resp.write_chunk(_usage_event(rid, g, sum(outs)))
            resp.write_chunk(b"data: [DONE]\n\n")
            resp.end_stream()
        elif g.kind != "generate":
            resp.send_json(200, _openai_body(rid, g, outs))
        elif g.batch is None:
            resp.send_json(200, _generate_body(rid, g, outs[0], "decode"))
        else:
            resp.send_json(200, [_generate_body(d.rid, it, d.generated, "decode") for it, d in zip(g.items, dreqs)])

    # -- load / info ----------------------------------------------------------------------
    def rank_loads(self) -> list[tuple[int, int, int]]:
        return self.prefill.rank_loads() if self.prefill is not None else self.decode.rank_loads()  # type: ignore[union-attr]

    def server_info(self) -> dict:
        p = self.p
        mode = {"prefill": "prefill", "decode": "decode", "regular": "null"}[self.role]
        loads = self.rank_loads()
        return {
            "model_path": f"sim/{p.model}", "served_model_name": p.model, "tokenizer_path": f"sim/{p.model}",
            "tp_size": p.dp_size, "dp_size": p.dp_size, "enable_dp_attention": p.dp_size > 1,
            "load_balance_method": "follow_bootstrap_room" if self.role == "prefill" else "round_robin",
            "disaggregation_mode": mode,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "max_running_requests": p.max_running_requests * p.dp_size,
            "max_total_num_tokens": p.max_total_num_tokens, "version": SIM_VERSION,
            "internal_states": [{"dp_rank": i, "max_total_num_tokens": p.max_total_num_tokens,
                                 "last_gen_throughput": 0.0, "num_running_reqs": lr[0]}
                                for i, lr in enumerate(loads)],
            "simulated": True, "time_scale": p.time_scale,
        }

    def loads_json(self, sections: set[str], dp_rank: Optional[int]) -> dict:
        p = self.p
        cap = p.max_total_num_tokens
        ts = time.time()
        out = []
        tot_run = tot_wait = tot_used = 0
        for i, (run, wait, used) in enumerate(self.rank_loads()):
            if dp_rank is not None and i != dp_rank:
                continue
            tot_run += run
            tot_wait += wait
            tot_used += used
            e: dict[str, Any] = {
                "dp_rank": i, "timestamp": ts, "num_running_reqs": run, "num_waiting_reqs": wait,
                "num_total_reqs": run + wait, "num_used_tokens": used, "max_total_num_tokens": cap,
                "token_usage": round(used / cap, 6) if cap else 0.0, "gen_throughput": 0.0,
                "cache_hit_rate": 0.0, "utilization": round(min(1.0, run / max(1, p.max_running_requests)), 6),
                "max_running_requests": p.max_running_requests,
            }
            if "memory" in sections:
                e["memory"] = {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": cap}
            if "spec" in sections:
                e["speculative"] = {"accept_length": 0.0, "accept_rate": 0.0}
            if "lora" in sections:
                e["lora"] = {"slots_used": 0, "slots_total": 0, "utilization": 0.0}
            if "disagg" in sections:
                d = {"mode": {"prefill": "prefill", "decode": "decode", "regular": "null"}[self.role],
                     "prefill_prealloc_queue_reqs": 0, "prefill_inflight_queue_reqs": 0,
                     "decode_prealloc_queue_reqs": 0, "decode_transfer_queue_reqs": 0,
                     "decode_retracted_queue_reqs": 0, "kv_transfer_speed_gb_s": 0.0,
                     "kv_transfer_latency_ms": 0.0}
                if self.role == "prefill":
                    d["prefill_prealloc_queue_reqs"] = wait
                elif self.decode is not None:
                    pre, trans, _, ret = self.decode.rank_queues(i)
                    d["decode_prealloc_queue_reqs"] = pre
                    d["decode_transfer_queue_reqs"] = trans
                    d["decode_retracted_queue_reqs"] = ret
                e["disaggregation"] = d
            if "queues" in sections:
                ret = self.decode.rank_queues(i)[3] if self.decode is not None else 0
                e["queues"] = {"waiting": wait - ret, "grammar": 0, "paused": 0, "retracted": ret}
            out.append(e)
        n = max(1, len(out))
        return {"timestamp": _now_ts(), "version": SIM_VERSION, "dp_rank_count": len(out), "loads": out,
                "aggregate": {"total_running_reqs": tot_run, "total_waiting_reqs": tot_wait,
                              "total_reqs": tot_run + tot_wait, "total_used_tokens": tot_used,
                              "avg_token_usage": round(tot_used / (cap * n), 6) if cap else 0.0,
                              "avg_throughput": 0.0, "avg_utilization": 0.0}}

    # route handlers
    async def _h_health(self, req: Request, resp: Responder) -> None:
        resp.send(200, b"", CT_TEXT)

    async def _h_server_info(self, req: Request, resp: Responder) -> None:
        resp.send_json(200, self.server_info())

    async def _h_model_info(self, req: Request, resp: Responder) -> None:
        resp.send_json(200, {"model_path": f"sim/{self.p.model}", "tokenizer_path": f"sim/{self.p.model}",
                             "is_generation": True, "model_type": "sim", "architectures": ["SimForCausalLM"],
                             "preferred_sampling_params": None})

    async def _h_models(self, req: Request, resp: Responder) -> None:
        resp.send_json(200, {"object": "list", "data": [
            {"id": self.p.model, "object": "model", "created": 0, "owned_by": "sglang",
             "root": f"sim/{self.p.model}", "max_model_len": self.p.max_total_num_tokens}]})

    async def _h_loads(self, req: Request, resp: Responder) -> None:
        q = req.query_params()
        inc = q.get("include", "all")
        sections: set[str] = set()
        for s in inc.split(","):
            s = s.strip()
            if not s:
                continue
            if s == "all":
                sections.update(LOAD_SECTIONS)
            elif s in LOAD_SECTIONS:
                sections.add(s)
            else:
                resp.send_json(400, {"error": f"unknown include section: {s}"})
                return
        dp_rank: Optional[int] = None
        if "dp_rank" in q:
            try:
                dp_rank = int(q["dp_rank"])
            except ValueError:
                resp.send_json(400, {"error": "dp_rank must be an integer"})
                return
            if not 0 <= dp_rank < self.p.dp_size:
                resp.send_json(400, {"error": f"dp_rank {dp_rank} out of range"})
                return
        data = self.loads_json(sections, dp_rank)
        if q.get("format") == "prometheus":
            lines = []
            for e in data["loads"]:
                for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage"):
                    lines.append(f'sglang_{k}{{dp_rank="{e["dp_rank"]}"}} {e[k]}')
            resp.send(200, ("\n".join(lines) + "\n").encode(), b"text/plain; version=0.0.4")
            return
        resp.send_json(200, data)

    async def _h_get_load(self, req: Request, resp: Responder) -> None:
        resp.send_json(200, [{"dp_rank": i, "num_reqs": run + wait, "num_waiting_reqs": wait, "num_tokens": used}
                             for i, (run, wait, used) in enumerate(self.rank_loads())])

    async def _h_flush(self, req: Request, resp: Responder) -> None:
        self.flushes += 1
        resp.send(200, b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
                       b"waiting requests, the operation will not be performed.)\n", CT_TEXT)

    async def _h_metrics(self, req: Request, resp: Responder) -> None:
        lines = []
        for i, (run, wait, used) in enumerate(self.rank_loads()):
            lab = f'{{dp_rank="{i}",model_name="{self.p.model}"}}'
            lines += [f"sglang_num_running_reqs{lab} {run}", f"sglang_num_queue_reqs{lab} {wait}",
                      f"sglang_token_usage{lab} {used / self.p.max_total_num_tokens:.6f}"]
        resp.send(200, ("\n".join(lines) + "\n").encode(), b"text/plain; version=0.0.4")

    async def _h_samples(self, req: Request, resp: Responder) -> None:
        """Debug: per-rank samples of a decode since ``?since=<unix time>`` (benchmark input)."""
        if self.decode is None:
            resp.send_json(404, {"error": "samples are recorded by decode workers only"})
            return
        since = float(req.query_params().get("since", "0") or 0)
        rows = [s for s in self.decode.samples if s[0] >= since]
        resp.send_json(200, {"dp_size": self.p.dp_size, "time_scale": self.p.time_scale, "samples": rows})

    async def _h_stats(self, req: Request, resp: Responder) -> None:
        eng = self.prefill if self.prefill is not None else self.decode
        d = {"role": self.role, "requests": self.requests, "completed": eng.completed,  # type: ignore[union-attr]
             "aborted": eng.aborted, "loads": self.rank_loads()}  # type: ignore[union-attr]
        if self.decode is not None:
            d.update(steps=self.decode.steps, tokens_out=self.decode.tokens_out, placed=self.decode.placed,
                     last_step_ms=self.decode.last_step_ms, retractions=self.decode.retractions,
                     queues=[self.decode.rank_queues(i) for i in range(self.p.dp_size)])
        resp.send_json(200, d)


_ROUTES = {
    "/health": SimWorker._h_health, "/health_generate": SimWorker._h_health,
    "/server_info": SimWorker._h_server_info, "/get_server_info": SimWorker._h_server_info,
    "/model_info": SimWorker._h_model_info, "/get_model_info": SimWorker._h_model_info,
    "/v1/models": SimWorker._h_models, "/v1/loads": SimWorker._h_loads, "/get_load": SimWorker._h_get_load,
    "/flush_cache": SimWorker._h_flush, "/metrics": SimWorker._h_metrics,
    "/sim/samples": SimWorker._h_samples, "/sim/stats": SimWorker._h_stats,
}


@dataclass
class SimCluster:
    """Prefill and decode simulators sharing one event loop (and so one rendezvous map)."""

    prefills: list[SimWorker] = field(default_factory=list)
    decodes: list[SimWorker] = field(default_factory=list)
    boards: dict[int, Rendezvous] = field(default_factory=dict)

    async def stop(self) -> None:
        for w in self.decodes + self.prefills:
            await w.stop()


async def start_cluster(n_prefill: int = 1, n_decode: int = 1, params: Optional[SimParams] = None,
                        prefill_params: Optional[SimParams] = None, host: str = "127.0.0.1") -> SimCluster:
    """Start ``n_prefill`` prefill and ``n_decode`` decode simulators on ephemeral ports."""
    params = params or SimParams()
    cluster = SimCluster()
    for _ in range(n_prefill):
        w = SimWorker("prefill", prefill_params or params, host, 0, 0, cluster.boards)
        await w.start()
        cluster.prefills.append(w)
    for _ in range(n_decode):
        w = SimWorker("decode", params, host, 0, None, cluster.boards)
        await w.start()
        cluster.decodes.append(w)
    return cluster


# ---------------------------------------------------------------------------------------------
# CLI


def add_param_flags(ap: argparse.ArgumentParser) -> None:
    """One ``--flag`` per SimParams field (dashes for underscores), defaults from the dataclass."""
    defaults = SimParams()
    for f in fields(SimParams):
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        if isinstance(default, bool):  # --retract / --no-retract (bool("False") would be True)
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, dest=f.name)
        elif f.name == "kv_transfer_scope":
            ap.add_argument(flag, choices=("server", "rank"), default=default, dest=f.name)
        else:
            ap.add_argument(flag, type=type(default), default=default, dest=f.name)


def params_from_args(ns: argparse.Namespace) -> SimParams:
    return SimParams(**{f.name: getattr(ns, f.name) for f in fields(SimParams)})


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastroute.sim.worker",
                                 description="Simulated SGLang PD worker with DP attention")
    ap.add_argument("--role", choices=("prefill", "decode", "regular"), required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--bootstrap-port", type=int, default=0,
                    help="prefill only: port of the simulated KV bootstrap listener (0 = ephemeral)")
    add_param_flags(ap)
    ns = ap.parse_args(argv)
    params = params_from_args(ns)

    async def run() -> None:
        w = SimWorker(ns.role, params, ns.host, ns.port, ns.bootstrap_port)
        await w.start()
        extra = f" bootstrap_port={w.bootstrap_port}" if ns.role == "prefill" else ""
        print(f"sim {ns.role} listening on {w.url} dp_size={params.dp_size}{extra}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await w.stop()

    try:
        import uvloop
        uvloop.run(run())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
