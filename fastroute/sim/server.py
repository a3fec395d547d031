"""One simulated SGLang server (``SimWorker``): its HTTP surface (protocol.md sections 2, 3.3, 3.6,
4, 5.1, 5.2, 6 as seen from a worker), the prefill's bootstrap listener, and per-rank load
reports, over the engines of ``engine`` and the wire shapes of ``api``.

Two layouts. Classic: one port for the whole server, whose DP controller places each request
(the body's rank key wins). Per-rank ports (``rank_ports=True``, like SGLang 0.5.23's Rust
server): rank r listens on base port + r and runs every request sent there on rank r, whatever
the body says; each port's ``/server_info`` carries ``deployment_info`` (``dp_size``,
``dp_rank``, ``disaggregation_bootstrap_port``) and its ``/v1/loads`` reports that rank only. A
per-rank-port prefill serves the bootstrap rooms on its API ports (the base port is the one it
reports), not on a listener of its own.

A client that closes its connection aborts its request and frees its slot and KV. If any item
of a batch never gets its room, the whole batch fails (500) and every item is freed.

KV events (``--kv-events-port-base``, see ``kvevents``): every rank publishes its prefix cache's
events (a prefill's, or a regular server's, which caches prompts without changing its timing)
and its LoadStat on ZMQ, advertised as the ``kv_events`` block of ``/server_info``. A start (or
restart) begins each rank's stream with ``AllBlocksCleared`` at seq 0; ``/flush_cache`` on an
idle server clears every rank (``AllBlocksCleared``) and answers 400 while anything runs or
waits, as SGLang does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from typing import Any

from fastroute.sim.api import _generate_body, _make_emitter, _openai_body, _usage_event, parse_inference
from fastroute.sim.engine import BadRequest, DecodeEngine, DecodeReq, ParsedGen, PrefillEngine, Rendezvous, SimParams
from fastroute.sim.http import CT_TEXT, HttpError, HttpServer, Request, Responder, bind_consecutive, fetch
from fastroute.sim.kvevents import KvEventsHub
from fastroute.sim.loads import SIM_VERSION, loads_doc
from fastroute.sim.prefixcache import PrefixCache

INFERENCE_PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues")


async def _rendezvous_http(host: str, port: int, room: int, timeout: float) -> tuple[bool, int | None]:
    """Long-poll a (possibly remote) simulated prefill's bootstrap listener for ``room``
    -> (arrived, the prefill rank that computed it if it says)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False, None
        poll = min(left, 30.0)
        try:
            status, body = await fetch(host, port, "GET", f"/room/{room}?timeout={poll:.3f}", timeout=poll + 5.0)
        except (HttpError, asyncio.TimeoutError):
            await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            continue
        if status == 200:
            try:
                rank = json.loads(body).get("rank")
            except (ValueError, AttributeError):
                rank = None
            return True, rank if isinstance(rank, int) else None


class _Ids:
    """Request ids: cheap, unique per server."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix
        self._n = 0

    def next(self) -> str:
        self._n += 1
        return f"{self._prefix}{self._n:x}"


class SimWorker:
    """One simulated SGLang server (role prefill | decode | regular) on ``host:port``.

    A prefill also runs its bootstrap listener on ``bootstrap_port`` (0 = ephemeral). ``boards``
    maps bootstrap port -> Rendezvous for prefills in the same process (see ``engine``'s docstring)."""

    def __init__(
        self,
        role: str,
        params: SimParams | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        bootstrap_port: int | None = None,
        boards: dict[int, Rendezvous] | None = None,
        rank_ports: bool = False,
    ) -> None:
        if role not in ("prefill", "decode", "regular"):
            raise ValueError(f"role must be prefill, decode or regular, not {role!r}")
        self.role = role
        self.p = params or SimParams()
        self.host = host
        self.boards = boards if boards is not None else {}
        self.board = Rendezvous()
        self.server = HttpServer(self._app, host, port)
        # Per-rank ports: rank r's listener is rank_servers[r] (rank 0's is ``server``).
        self.rank_ports = bool(rank_ports)
        self.rank_servers: list[HttpServer] = [self.server]
        if self.rank_ports:
            self.rank_servers += [HttpServer(self._rank_app(r), host, 0) for r in range(1, self.p.dp_size)]
        self.bootstrap_port = bootstrap_port if role == "prefill" else None
        self._boot: HttpServer | None = None
        self.prefill = PrefillEngine(self.p, self.board) if role == "prefill" else None
        self.decode = DecodeEngine(self.p) if role != "prefill" else None
        if self.p.kv_events_port_base != 0 and role != "decode" and self.p.prefix_cache_tokens <= 0:
            raise ValueError(f"--kv-events-port-base on a {role} server needs --prefix-cache-tokens > 0")
        # A regular server's ranks cache prompts too (events only: its timing has no prefill).
        cap = self.p.prefix_cache_tokens // self.p.prefix_block_tokens
        self.caches = [PrefixCache(cap, self.p.prefix_block_tokens) for _ in range(self.p.dp_size)]
        if self.prefill is not None:
            self.caches = [r.cache for r in self.prefill.ranks]
        self._ids = _Ids({"prefill": "p", "decode": "d", "regular": "r"}[role] + "%x-" % (id(self) & 0xFFFF))
        self.requests = 0
        self.flushes = 0
        self.last_bodies: deque = deque(maxlen=16)  # recent inference bodies, for tests/debugging
        # The W3C traceparent of each recent inference request (None: it had none), for tests.
        self.traceparents: deque = deque(maxlen=64)
        self.port_requests = [0] * len(self.rank_servers)  # inference requests per listener
        self.wrong_prefill_rank = 0  # decode items whose disagg_prefill_dp_rank was not the room's
        # KV events and LoadStat per rank over ZMQ (kvevents), with --kv-events-port-base
        self.kv_events: KvEventsHub | None = None

    def _rank_app(self, rank: int) -> Any:
        async def app(req: Request, resp: Responder) -> None:
            await self._app(req, resp, rank)

        return app

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.server.port}"

    def rank_url(self, rank: int) -> str:
        return f"http://{self.host}:{self.rank_servers[rank].port}"

    async def start(self) -> None:
        if self.rank_ports:
            await bind_consecutive(self.rank_servers, self.server.port)
            if self.role == "prefill":
                # Like the Rust server: the rooms are served on the API port itself.
                self.bootstrap_port = self.server.port
                self.boards[self.bootstrap_port] = self.board
        else:
            await self.server.start()
        if self.role == "prefill" and not self.rank_ports:
            self._boot = HttpServer(self._boot_app, self.host, self.bootstrap_port or 0)
            await self._boot.start()
            self.bootstrap_port = self._boot.port
            self.boards[self.bootstrap_port] = self.board
        if self.decode is not None:
            self.decode.start()
        if self.prefill is not None:
            self.prefill.start()
        if self.p.kv_events_port_base != 0:
            await self._start_kv_events()

    async def _start_kv_events(self) -> None:
        """Bind the per-rank publishers; a (re)started server's caches start empty, and each rank's
        first batch says so (AllBlocksCleared, seq 0)."""
        eng = self.prefill
        if eng is not None:
            hub = KvEventsHub(self.p, self.host, eng.load_stat)
        else:
            dec, regular = self.decode, self.role == "regular"
            assert dec is not None
            hub = KvEventsHub(self.p, self.host, lambda i: dec.load_stat(i, regular))
        for c in self.caches:
            c.sink = None
            c.clear()
        try:
            await hub.start()
        except BaseException:
            await self.stop()
            raise
        self.kv_events = hub
        for i, c in enumerate(self.caches):
            c.sink = hub.sink(i)
        if eng is not None:
            eng.on_change = hub.poke

    async def stop(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.stop()
            self.kv_events = None
        if self.prefill is not None:
            self.prefill.on_change = None
        for c in self.caches:
            c.sink = None
        if self.decode is not None:
            await self.decode.stop()
        if self.prefill is not None:
            await self.prefill.stop()
        for srv in self.rank_servers:
            await srv.stop()
        if self.rank_ports and self.role == "prefill":
            self.boards.pop(self.bootstrap_port or -1, None)
        if self._boot is not None:
            await self._boot.stop()
            self.boards.pop(self.bootstrap_port or -1, None)

    # -- bootstrap listener ---------------------------------------------------------------
    async def stop_rank(self, rank: int) -> None:
        """Close rank ``rank``'s listener (per-rank ports): that rank's port goes down alone."""
        await self.rank_servers[rank].stop()

    async def start_rank(self, rank: int) -> None:
        await self.rank_servers[rank].start()

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
        resp.send_json(
            200 if ok else 404, {"room": room, "ready": ok, "rank": self.board.origin.pop(room, None) if ok else None}
        )

    # -- main app -------------------------------------------------------------------------
    async def _app(self, req: Request, resp: Responder, rank: int | None = None) -> None:
        """One request on the server's port (``rank`` None: classic; with per-rank ports the
        listener's rank, 0 for the base port)."""
        path = req.path
        if self.rank_ports and rank is None:
            rank = 0
        if path in INFERENCE_PATHS:
            if req.method != "POST":
                resp.send_json(405, {"detail": "Method Not Allowed"})
                return
            self.requests += 1
            self.port_requests[rank or 0] += 1
            await self._inference(req, resp, rank)
            return
        if self.rank_ports and self.role == "prefill" and path.startswith("/room/"):
            await self._boot_app(req, resp)
            return
        handler = _ROUTES.get(path)
        if handler is None:
            resp.send_json(404, {"detail": "Not Found"})
            return
        if rank is not None and handler in _RANKED:
            await handler(self, req, resp, rank)
        else:
            await handler(self, req, resp)

    async def _inference(self, req: Request, resp: Responder, rank: int | None = None) -> None:
        try:
            g = parse_inference(req.path, req.body, self.p)
            if len(self.last_bodies) == self.last_bodies.maxlen:
                self.last_bodies.popleft()
            self.last_bodies.append((req.path, req.body if len(req.body) < 4096 else req.body[:4096]))
            tp = req.headers.get(b"traceparent")
            self.traceparents.append(tp.decode("latin-1") if tp is not None else None)
            if rank is not None:
                # A rank's own port: the request runs there, whatever rank the body names.
                for it in g.items:
                    it.rank = rank
            if self.role == "prefill":
                await self._serve_prefill(g, resp)
            else:
                await self._serve_decode(g, resp)
        except BadRequest as exc:
            resp.send_json(
                400,
                {
                    "error": {"message": str(exc), "code": 400},
                    "object": "error",
                    "message": str(exc),
                    "type": "BadRequestError",
                    "code": 400,
                },
            )

    async def _serve_prefill(self, g: ParsedGen, resp: Responder) -> None:
        eng = self.prefill
        assert eng is not None
        ranks = eng.place(g.items)
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
            resp.write_chunk(
                b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            )
            resp.end_stream()
        else:
            resp.send_json(200, body)

    async def _await_kv(self, it: ParsedGen, dreq: DecodeReq) -> bool:
        """Wait for item ``it``'s bootstrap room, then let its request join the batch. A decode
        told the prefill rank (``disagg_prefill_dp_rank``) fails the item when the room was
        computed on another rank (a real decode would fetch the KV from the wrong rank)."""
        if self.role == "decode" and it.room is not None:
            board = self.boards.get(it.bootstrap_port) if it.bootstrap_port is not None else None
            origin: int | None = None
            if board is not None:
                ok = await board.wait(it.room, self.p.rendezvous_timeout_s)
                origin = board.origin.pop(it.room, None)
            elif it.bootstrap_host and it.bootstrap_port:
                ok, origin = await _rendezvous_http(
                    it.bootstrap_host, it.bootstrap_port, it.room, self.p.rendezvous_timeout_s
                )
            else:
                ok = False
            if ok and it.prefill_rank is not None and origin is not None and origin != it.prefill_rank:
                self.wrong_prefill_rank += 1
                return False
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
        ranks = eng.place([(it.rank, it.room, it.input_tokens) for it in g.items])
        if self.role == "regular" and self.p.prefix_cache_tokens > 0:
            for it, rank in zip(g.items, ranks):
                if it.blocks:
                    self.caches[rank].insert(it.blocks, it.token_ids)
        try:
            for it, rank in zip(g.items, ranks):
                irid = rid if g.batch is None else f"{rid}.{it.index}"
                emit = _make_emitter(resp, irid, it) if g.stream else None
                dreq = DecodeReq(irid, rank, it.input_tokens, it.max_new, emit, loop.create_future())
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
                    resp.send_json(
                        500,
                        {
                            "error": {"message": msg, "code": 500},
                            "object": "error",
                            "message": msg,
                            "type": "InternalServerError",
                            "code": 500,
                        },
                    )
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

    def server_info(self, rank: int | None = None) -> dict:
        """``/server_info``; on a rank port (``rank``) with that rank's ``deployment_info``."""
        info = self._server_info()
        if rank is not None:
            info["deployment_info"] = {
                "dp_size": self.p.dp_size,
                "dp_rank": rank,
                "node_rank": 0,
                "nnodes": 1,
                "disaggregation_bootstrap_port": self.bootstrap_port,
                "enable_dp_attention": self.p.dp_size > 1,
                "max_running_requests": self.p.max_running_requests,
            }
        return info

    def _server_info(self) -> dict:
        p = self.p
        mode = {"prefill": "prefill", "decode": "decode", "regular": "null"}[self.role]
        loads = self.rank_loads()
        info = {
            "model_path": f"sim/{p.model}",
            "served_model_name": p.model,
            "tokenizer_path": f"sim/{p.model}",
            "tp_size": p.dp_size,
            "dp_size": p.dp_size,
            "enable_dp_attention": p.dp_size > 1,
            "load_balance_method": (self.prefill or self.decode).ctl.method,  # type: ignore[union-attr]
            "disaggregation_mode": mode,
            "disaggregation_bootstrap_port": self.bootstrap_port,
            "max_running_requests": p.max_running_requests * p.dp_size,
            "max_total_num_tokens": p.max_total_num_tokens,
            "version": SIM_VERSION,
            "internal_states": [
                {
                    "dp_rank": i,
                    "max_total_num_tokens": p.max_total_num_tokens,
                    "last_gen_throughput": 0.0,
                    "num_running_reqs": lr[0],
                }
                for i, lr in enumerate(loads)
            ],
            "simulated": True,
            "time_scale": p.time_scale,
        }
        kv = self.kv_events.describe() if self.kv_events is not None else None
        if kv is not None:
            info["kv_events"] = kv
        return info

    def loads_json(self, sections: set[str], dp_rank: int | None) -> dict:
        """``/v1/loads`` (``sections``: the include list; ``dp_rank``: one rank, else all)."""
        return loads_doc(self, sections, dp_rank)

    # route handlers
    async def _h_health(self, req: Request, resp: Responder) -> None:
        resp.send(200, b"", CT_TEXT)

    async def _h_server_info(self, req: Request, resp: Responder, rank: int | None = None) -> None:
        resp.send_json(200, self.server_info(rank))

    async def _h_model_info(self, req: Request, resp: Responder) -> None:
        resp.send_json(
            200,
            {
                "model_path": f"sim/{self.p.model}",
                "tokenizer_path": f"sim/{self.p.model}",
                "is_generation": True,
                "model_type": "sim",
                "architectures": ["SimForCausalLM"],
                "preferred_sampling_params": None,
            },
        )

    async def _h_models(self, req: Request, resp: Responder) -> None:
        resp.send_json(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": self.p.model,
                        "object": "model",
                        "created": 0,
                        "owned_by": "sglang",
                        "root": f"sim/{self.p.model}",
                        "max_model_len": self.p.max_total_num_tokens,
                    }
                ],
            },
        )

    async def _h_loads(self, req: Request, resp: Responder, rank: int | None = None) -> None:
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
        dp_rank: int | None = None
        if "dp_rank" in q:
            try:
                dp_rank = int(q["dp_rank"])
            except ValueError:
                resp.send_json(400, {"error": "dp_rank must be an integer"})
                return
            if not 0 <= dp_rank < self.p.dp_size:
                resp.send_json(400, {"error": f"dp_rank {dp_rank} out of range"})
                return
        if rank is not None:  # a rank port reports its own rank
            if dp_rank is not None and dp_rank != rank:
                resp.send_json(400, {"error": f"this port serves dp_rank {rank}"})
                return
            dp_rank = rank
        data = self.loads_json(sections, dp_rank)
        if q.get("format") == "prometheus":
            lines = []
            for e in data["loads"]:
                for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage"):
                    lines.append(f'sglang_{k}{{dp_rank="{e["dp_rank"]}"}} {e[k]}')
            resp.send(200, ("\n".join(lines) + "\n").encode(), b"text/plain; version=0.0.4")
            return
        resp.send_json(200, data)

    async def _h_get_load(self, req: Request, resp: Responder, rank: int | None = None) -> None:
        resp.send_json(
            200,
            [
                {"dp_rank": i, "num_reqs": run + wait, "num_waiting_reqs": wait, "num_tokens": used}
                for i, (run, wait, used) in enumerate(self.rank_loads())
                if rank is None or i == rank
            ],
        )

    async def _h_flush(self, req: Request, resp: Responder) -> None:
        if any(run or wait for run, wait, _ in self.rank_loads()):
            # SGLang flushes only an idle server (each rank's cache: AllBlocksCleared).
            resp.send(400, b"Flush cache failed.\n", CT_TEXT)
            return
        for c in self.caches:
            c.clear()
        self.flushes += 1
        resp.send(
            200,
            b"Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            b"waiting requests, the operation will not be performed.)\n",
            CT_TEXT,
        )

    async def _h_metrics(self, req: Request, resp: Responder) -> None:
        lines = []
        for i, (run, wait, used) in enumerate(self.rank_loads()):
            lab = f'{{dp_rank="{i}",model_name="{self.p.model}"}}'
            lines += [
                f"sglang_num_running_reqs{lab} {run}",
                f"sglang_num_queue_reqs{lab} {wait}",
                f"sglang_token_usage{lab} {used / self.p.max_total_num_tokens:.6f}",
            ]
        resp.send(200, ("\n".join(lines) + "\n").encode(), b"text/plain; version=0.0.4")

    async def _h_samples(self, req: Request, resp: Responder) -> None:
        """Debug: per-rank samples since ``?since=<unix time>`` (benchmark input): a decode's
        (t, step_ms, running, outstanding, used, prealloc), a prefill's (t, outstanding, tokens)."""
        since = float(req.query_params().get("since", "0") or 0)
        eng = self.decode if self.decode is not None else self.prefill
        rows = [s for s in eng.samples if s[0] >= since]  # type: ignore[union-attr]
        resp.send_json(200, {"dp_size": self.p.dp_size, "time_scale": self.p.time_scale, "samples": rows})

    async def _h_kv_drop(self, req: Request, resp: Responder) -> None:
        """Debug: ``POST /sim/kv_events/drop?rank=R&n=N``: rank R's next N KV event batches are
        kept for replay but not sent (``KvEventsHub.drop``)."""
        q = req.query_params()
        try:
            rank, n = int(q.get("rank", "")), int(q.get("n", "1"))
        except ValueError:
            resp.send_json(400, {"error": "rank and n must be integers"})
            return
        if self.kv_events is None or req.method != "POST" or not 0 <= rank < self.p.dp_size or n < 0:
            resp.send_json(400, {"error": "needs POST, KV events on, 0 <= rank < dp_size and n >= 0"})
            return
        self.kv_events.drop(rank, n)
        resp.send_json(200, {"rank": rank, "drop": n})

    async def _h_stats(self, req: Request, resp: Responder) -> None:
        eng = self.prefill if self.prefill is not None else self.decode
        assert eng is not None  # a simulated worker runs a prefill or a decode engine
        d = {
            "role": self.role,
            "requests": self.requests,
            "completed": eng.completed,
            "aborted": eng.aborted,
            "loads": self.rank_loads(),
            "dispatch": {
                "method": eng.ctl.method,
                "placed": eng.ctl.placed,
                "refreshes": eng.ctl.refreshes,
            },
        }
        if self.decode is not None:
            d.update(
                steps=self.decode.steps,
                tokens_out=self.decode.tokens_out,
                placed=self.decode.placed,
                last_step_ms=self.decode.last_step_ms,
                retractions=self.decode.retractions,
                queues=[self.decode.rank_queues(i) for i in range(self.p.dp_size)],
            )
        resp.send_json(200, d)


_ROUTES = {
    "/health": SimWorker._h_health,
    "/health_generate": SimWorker._h_health,
    "/server_info": SimWorker._h_server_info,
    "/get_server_info": SimWorker._h_server_info,
    "/model_info": SimWorker._h_model_info,
    "/get_model_info": SimWorker._h_model_info,
    "/v1/models": SimWorker._h_models,
    "/v1/loads": SimWorker._h_loads,
    "/get_load": SimWorker._h_get_load,
    "/flush_cache": SimWorker._h_flush,
    "/metrics": SimWorker._h_metrics,
    "/sim/samples": SimWorker._h_samples,
    "/sim/stats": SimWorker._h_stats,
    "/sim/kv_events/drop": SimWorker._h_kv_drop,
}
# Handlers that answer for one rank on a rank port.
_RANKED = {SimWorker._h_server_info, SimWorker._h_loads, SimWorker._h_get_load}
