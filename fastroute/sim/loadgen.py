"""Closed-loop load generator: C clients replaying a trace as streaming /generate requests.

Owns the trace (a seeded synthetic input-heavy agentic trace, or a user JSONL file), the client
loop (raw asyncio + httptools, one keep-alive connection per client), per-request timing and
the summary metrics: TTFT, TPOT and ITL p50/p90, interactivity (tokens/s per user = 1/TPOT),
output throughput.

Input representation: a request of N input tokens is sent as ``text`` of exactly 4*N ASCII
bytes. Both the router's estimator (``ceil(utf8 bytes / 4)``) and the simulator
(``ceil(chars / 4)``) count that as N tokens, and a 120 KB JSON string costs the router a
fraction of what parsing a 30k-element ``input_ids`` list would. ``--input-format ids`` sends
``input_ids`` instead (exact count, heavier to parse).

JSONL trace format, one request per line (extra keys ignored)::

    {"input_tokens": 31000, "output_tokens": 220}
    {"text": "...", "output_tokens": 300}          # token count = ceil(len(text) / 4)
    {"input_ids": [1, 2, 3], "output_tokens": 150}

Mini-router mode (``--prefill HOST:PORT:BOOTSTRAP_PORT --decode HOST:PORT``) plays the router
itself: it injects ``bootstrap_host/port/room`` and sends both legs concurrently, with no DP
rank (the decode's own round-robin places the request): the no-router baseline.

Percentile conventions: "p90" of a latency is its 90th percentile; "p90" of interactivity is
the value 90% of requests beat (its 10th percentile, = 1000 / TPOT p90), as in seed 001.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import uvloop

from fastroute.sim.http import HttpConnection, HttpError

_FILLER = b"tok " * 262_144  # 1 MiB of ASCII; sliced, never copied per token


@dataclass
class TraceItem:
    """One request of a trace. ``text`` / ``input_ids`` override the generated input."""

    input_tokens: int
    output_tokens: int
    text: str | None = None
    input_ids: list | None = None


def synthetic_trace(
    n: int = 4000,
    seed: int = 0,
    input_mean: float = 30_000,
    input_sigma: float = 1.0,
    input_min: int = 1_000,
    input_max: int = 200_000,
    output_mean: float = 250,
    output_min: int = 100,
    output_max: int = 500,
) -> list[TraceItem]:
    """Input-heavy agentic trace: lognormal inputs (mean ~``input_mean`` before clipping, heavy
    right tail) and short lognormal outputs clipped to [output_min, output_max]."""
    rng = random.Random(seed)
    mu_in = math.log(input_mean) - input_sigma**2 / 2
    mu_out = math.log(output_mean) - 0.5**2 / 2
    items = []
    for _ in range(n):
        i = int(min(input_max, max(input_min, rng.lognormvariate(mu_in, input_sigma))))
        o = int(min(output_max, max(output_min, rng.lognormvariate(mu_out, 0.5))))
        items.append(TraceItem(i, o))
    return items


def load_trace(path: str) -> list[TraceItem]:
    items = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            d = json.loads(line)
            out = int(d.get("output_tokens", d.get("max_new_tokens", 256)))
            if "input_ids" in d:
                items.append(TraceItem(len(d["input_ids"]), out, input_ids=list(d["input_ids"])))
            elif "text" in d:
                items.append(TraceItem(max(1, math.ceil(len(d["text"].encode()) / 4)), out, text=d["text"]))
            elif "input_tokens" in d:
                items.append(TraceItem(int(d["input_tokens"]), out))
            else:
                raise ValueError(f"{path}:{lineno}: need input_tokens, text or input_ids")
    if not items:
        raise ValueError(f"{path}: empty trace")
    return items


def encode_request(item: TraceItem, input_format: str = "text", stream: bool = True) -> bytes:
    """JSON body for /generate; built by concatenation so a 120 KB input is not re-escaped."""
    tail = b'"sampling_params":{"max_new_tokens":%d,"ignore_eos":true},"stream":%s}' % (
        item.output_tokens,
        b"true" if stream else b"false",
    )
    if item.input_ids is not None:
        return b'{"input_ids":' + json.dumps(item.input_ids).encode() + b"," + tail
    if item.text is not None:
        return b'{"text":' + json.dumps(item.text).encode() + b"," + tail
    if input_format == "ids":
        return b'{"input_ids":[' + b"1," * (item.input_tokens - 1) + b"1]," + tail
    n = 4 * item.input_tokens
    filler = _FILLER if n <= len(_FILLER) else _FILLER * (n // len(_FILLER) + 1)
    return b'{"text":"' + filler[:n] + b'",' + tail


@dataclass
class ReqRecord:
    t_start: float
    input_tokens: int
    t_first: float = 0.0
    t_last: float = 0.0
    n_tokens: int = 0
    ok: bool = False
    error: str = ""
    token_times: list = field(default_factory=list)
    headers: dict | None = None  # extra headers it was sent with (latency targets)


class _SSECounter:
    """Counts SSE token events as chunks arrive; events may straddle chunk boundaries."""

    __slots__ = ("rec", "buf", "done", "error", "clock")

    def __init__(self, rec: ReqRecord, clock: Callable[[], float]) -> None:
        self.rec = rec
        self.buf = b""
        self.done = False
        self.error = ""
        self.clock = clock

    def feed(self, chunk: bytes) -> None:
        buf = self.buf + chunk if self.buf else chunk
        if b"\n\n" not in buf:
            self.buf = buf
            return
        now = self.clock()
        events = buf.split(b"\n\n")
        self.buf = events.pop()
        rec = self.rec
        for ev in events:
            if not ev.startswith(b"data:"):
                continue  # comments / keep-alives
            if ev.startswith(b"data: [DONE]"):
                self.done = True
            elif ev.startswith(b'data: {"error"'):
                self.error = ev[6:200].decode("utf-8", "replace")
            else:
                if rec.n_tokens == 0:
                    rec.t_first = now
                rec.n_tokens += 1
                rec.t_last = now
                rec.token_times.append(now)


@dataclass
class Target:
    """Where clients send: a router (host, port) or, in mini-router mode, both legs."""

    host: str
    port: int
    path: str = "/generate"
    prefill: tuple[str, int, int] | None = None  # (host, port, bootstrap_port) => mini-router mode
    headers: dict[str, str] | None = None
    # Router replicas behind one Service: client i keeps ports[i mod len] (its connection is
    # long-lived, as through an L4 balancer); ``port`` is used when this is empty.
    ports: tuple[int, ...] = ()

    def port_of(self, client: int) -> int:
        return self.ports[client % len(self.ports)] if self.ports else self.port


def _percentile(vals: list[float], q: float) -> float:
    if not vals:
        return float("nan")
    s = sorted(vals)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class LoadResult:
    concurrency: int
    duration_s: float
    records: list[ReqRecord]
    window: tuple[float, float]
    errors: int

    def summary(self) -> dict:
        t0, t1 = self.window
        done = [r for r in self.records if r.ok and r.t_start >= t0 and r.t_last <= t1]
        ttft = [(r.t_first - r.t_start) * 1000 for r in done if r.n_tokens]
        tpot = [(r.t_last - r.t_first) * 1000 / (r.n_tokens - 1) for r in done if r.n_tokens > 1]
        itl: list[float] = []
        for r in done:
            tt = r.token_times
            itl.extend((tt[i] - tt[i - 1]) * 1000 for i in range(1, len(tt)))
        toks = sum(1 for r in self.records for t in r.token_times if t0 <= t <= t1)
        inter = [1000.0 / x for x in tpot if x > 0]
        span = max(1e-9, t1 - t0)
        return {
            "concurrency": self.concurrency,
            "completed": len(done),
            "completed_total": sum(1 for r in self.records if r.ok),
            "errors": self.errors,
            "window_s": round(span, 2),
            "output_tok_s": toks / span,
            "requests_per_s": len(done) / span,
            "ttft_p50_ms": _percentile(ttft, 50),
            "ttft_p90_ms": _percentile(ttft, 90),
            "tpot_p50_ms": _percentile(tpot, 50),
            "tpot_p90_ms": _percentile(tpot, 90),
            "itl_p50_ms": _percentile(itl, 50),
            "itl_p90_ms": _percentile(itl, 90),
            "interactivity_p50": _percentile(inter, 50),
            "interactivity_p90": _percentile(inter, 10),
        }


async def _one(
    conn: HttpConnection,
    prefill_conn: HttpConnection | None,
    target: Target,
    body: bytes,
    rec: ReqRecord,
    rng: random.Random,
    timeout: float,
) -> None:
    loop = asyncio.get_running_loop()
    counter = _SSECounter(rec, loop.time)
    try:
        if prefill_conn is None:
            status, _, _ = await asyncio.wait_for(
                conn.request("POST", target.path, body, target.headers, on_chunk=counter.feed), timeout
            )
        else:
            assert target.prefill is not None
            ph, _, pboot = target.prefill
            room = rng.randrange(0, (1 << 63) - (1 << 16))  # protocol.md 3.3 range
            inj = b',"bootstrap_host":"%s","bootstrap_port":%d,"bootstrap_room":%d}' % (ph.encode(), pboot, room)
            leg = body[:-1] + inj
            loop_ = asyncio.get_running_loop()
            legs = (
                loop_.create_task(prefill_conn.request("POST", target.path, leg, target.headers)),
                loop_.create_task(conn.request("POST", target.path, leg, target.headers, on_chunk=counter.feed)),
            )
            try:
                done, _ = await asyncio.wait(legs, timeout=timeout)
                if len(done) < 2:
                    raise asyncio.TimeoutError()
                pre, dec = legs[0].result(), legs[1].result()
            finally:
                # Either leg failing (or this client being cancelled) ends both, like a router.
                for t in legs:
                    t.cancel()
                await asyncio.gather(*legs, return_exceptions=True)
            status = dec[0] if dec[0] != 200 else pre[0]
    except (HttpError, asyncio.TimeoutError) as exc:
        rec.error = repr(exc)
        conn.close()
        if prefill_conn is not None:
            prefill_conn.close()
        return
    if status != 200:
        rec.error = f"status {status}"
    elif counter.error:
        rec.error = counter.error
    else:
        rec.ok = counter.done
        if not rec.ok:
            rec.error = "stream ended without [DONE]"


async def run_load(
    target: Target,
    trace: list[TraceItem],
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.0,
    input_format: str = "text",
    seed: int = 0,
    request_timeout_s: float = 600.0,
    progress: bool = False,
    max_requests: int | None = None,
) -> LoadResult:
    """Run C closed-loop clients for ``warmup_s + duration_s`` and measure the last ``duration_s``.

    Requests still open at the end are aborted (their connection closed), which the simulated
    decode sees as a client disconnect. With ``max_requests``, clients stop after that many
    requests in total (the run may then end early)."""
    loop = asyncio.get_running_loop()
    t_begin = loop.time()
    t_measure = t_begin + warmup_s
    t_end = t_measure + duration_s
    records: list[ReqRecord] = []
    errors = 0
    bodies: dict[int, bytes] = {}
    counter = {"next": 0, "issued": 0}
    rng = random.Random(seed ^ 0x5EED)

    def next_item() -> tuple[int, TraceItem] | None:
        if max_requests is not None and counter["issued"] >= max_requests:
            return None
        i = counter["next"]
        counter["next"] = (i + 1) % len(trace)
        counter["issued"] += 1
        return i, trace[i]

    async def client(cid: int) -> None:
        nonlocal errors
        conn = HttpConnection(target.host, target.port_of(cid))
        pconn = HttpConnection(target.prefill[0], target.prefill[1]) if target.prefill else None
        try:
            while loop.time() < t_end:
                nxt = next_item()
                if nxt is None:
                    return
                idx, item = nxt
                body = bodies.get(idx)
                if body is None:
                    body = encode_request(item, input_format)
                    if len(bodies) < 256:  # cache a few; the large ones are cheap to rebuild anyway
                        bodies[idx] = body
                rec = ReqRecord(loop.time(), item.input_tokens)
                records.append(rec)
                await _one(conn, pconn, target, body, rec, rng, request_timeout_s)
                if not rec.ok:
                    errors += 1
                    await asyncio.sleep(0.05)  # do not spin on a failing target
        finally:
            conn.close()
            if pconn is not None:
                pconn.close()

    async def reporter() -> None:
        while True:
            await asyncio.sleep(5.0)
            now = loop.time()
            ok = sum(1 for r in records if r.ok)
            recent = [r for r in records if r.ok and r.t_last >= now - 5.0]
            toks = sum(1 for r in records[-4 * concurrency :] for t in r.token_times if t >= now - 5.0)
            print(
                f"  [load C={concurrency}] t={now - t_begin:5.1f}s done={ok} recent={len(recent)} "
                f"err={errors} out_tok/s~{toks / 5.0:.0f} wall-clock",
                file=sys.stderr,
                flush=True,
            )

    tasks = [loop.create_task(client(i)) for i in range(concurrency)]
    rep = loop.create_task(reporter()) if progress else None
    try:
        timeout = max(0.0, t_end - loop.time())
        done, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        if rep is not None:
            rep.cancel()
    t_stop = min(loop.time(), t_end)
    return LoadResult(concurrency, t_stop - t_measure, records, (t_measure, t_stop), errors)


def scale_summary(s: dict, time_scale: float) -> dict:
    """Convert a summary measured against simulators running at ``time_scale`` to simulated time."""
    out = dict(s)
    for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "itl_p50_ms", "itl_p90_ms"):
        out[k] = s[k] / time_scale
    for k in ("output_tok_s", "requests_per_s", "interactivity_p50", "interactivity_p90"):
        out[k] = s[k] * time_scale
    return out


def format_summary(s: dict) -> str:
    return (
        f"C={s['concurrency']} completed={s['completed']} errors={s['errors']} "
        f"out_tok/s={s['output_tok_s']:.1f} TTFT p50/p90={s['ttft_p50_ms']:.0f}/{s['ttft_p90_ms']:.0f} ms "
        f"TPOT p50/p90={s['tpot_p50_ms']:.1f}/{s['tpot_p90_ms']:.1f} ms "
        f"ITL p50/p90={s['itl_p50_ms']:.1f}/{s['itl_p90_ms']:.1f} ms "
        f"interactivity p50/p90={s['interactivity_p50']:.1f}/{s['interactivity_p90']:.1f} tok/s"
    )


def _hostport(s: str) -> tuple[str, int]:
    s = s.split("://", 1)[-1].rstrip("/")
    h, _, p = s.rpartition(":")
    return h, int(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastroute.sim.loadgen", description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="router URL, e.g. http://127.0.0.1:30000")
    ap.add_argument("--prefill", help="mini-router mode: HOST:PORT:BOOTSTRAP_PORT of the prefill")
    ap.add_argument("--decode", help="mini-router mode: HOST:PORT of the decode")
    ap.add_argument("--concurrency", "-c", type=int, default=64)
    ap.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--trace", help="JSONL trace (default: synthetic)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-mean", type=float, default=30_000)
    ap.add_argument("--output-mean", type=float, default=250)
    ap.add_argument("--input-format", choices=("text", "ids"), default="text")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="the simulators' --time-scale: report simulated time (wall / scale); 1 = wall clock",
    )
    ns = ap.parse_args(argv)
    if ns.url:
        h, p = _hostport(ns.url)
        target = Target(h, p)
    elif ns.prefill and ns.decode:
        ph, pp_b = ns.prefill.rsplit(":", 1)
        ph2, pp = _hostport(ph)
        dh, dp = _hostport(ns.decode)
        target = Target(dh, dp, prefill=(ph2, pp, int(pp_b)))
    else:
        ap.error("give --url, or --prefill and --decode")
    trace = (
        load_trace(ns.trace)
        if ns.trace
        else synthetic_trace(seed=ns.seed, input_mean=ns.input_mean, output_mean=ns.output_mean)
    )

    async def run() -> dict:
        res = await run_load(
            target, trace, ns.concurrency, ns.duration, ns.warmup, ns.input_format, ns.seed, progress=True
        )
        return scale_summary(res.summary(), ns.time_scale)

    s = uvloop.run(run())
    print(json.dumps(s, indent=1) if ns.json else format_summary(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
