"""Memory per stream: peak RSS of one fastroute process holding N concurrent SSE streams.

Owns one run:

* a **slow-streaming backend** (this file, started again as a subprocess with ``--backend``): one
  uvloop + httptools server that answers what fastroute asks a worker at registration and while
  polling (``/health``, ``/server_info``, ``/model_info``, ``/v1/models``, ``/v1/loads``, ... with
  the fixed SGLang-shaped bodies of ``bench/overhead.py``), and answers ``POST
  /v1/chat/completions`` with a chunked ``text/event-stream`` that sends its first event at once
  and then one ``data: {...}`` event every ``--interval`` seconds until the connection closes (a
  decode that never ends, so every stream stays open as long as the client holds it);
* for each N in ``--streams``: a **fresh** ``python -m fastroute --worker-urls <backend>`` (regular
  mode, default flags apart from the host and ports), its idle RSS once it is ready, then N
  streams opened through it from this process (raw asyncio protocols, in batches, all held at
  once), a check that every stream answered 200 and got its first event, a ``--hold`` second
  window sampling ``/proc/PID/status`` (VmRSS; VmHWM is the peak) in which every stream must get
  more events, then every stream is closed and the RSS read again after the upstream pool's idle
  timeout.

One router process per N, not one process with increasing N: the bar is the peak RSS (VmHWM,
which never goes down) of a router serving N streams, and a router that already held and freed
fewer streams would start the next N with an allocator that has grown arenas and free lists, so
its rows would not be what a router serving N streams costs. Any failure (a non-200, a stream
without events, a stream that stops before the window ends, the router exiting) stops the run
with a non-zero status.

Output: a markdown table (N, idle RSS, RSS held, peak RSS, peak - idle per stream, RSS after the
streams closed), printed and written to ``bench/out/memory.md``. Every process started here is
stopped on exit.  Usage: ``python bench/memory.py [--streams 1000 2000 5000] [--interval 1]
[--hold 5] [--prompt-bytes 200] [--out FILE] [-- extra fastroute flags]``; ``--shape generate``
runs bench/memory_generate.py instead (5,000 aiohttp /generate streams through P2C).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httptools
import uvloop

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from overhead import MODEL, Procs, free_port, worker_bodies  # noqa: E402

SSE_PATH = "/v1/chat/completions"
# File descriptors per held stream in the router: the client socket and the upstream socket.
FDS_PER_STREAM = 2


# ----------------------------------------------------------------------------- backend


def _event(i: int) -> bytes:
    chunk = {
        "id": "chatcmpl-membench",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}],
    }
    data = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def _answers() -> dict[bytes, bytes]:
    """GET path -> full response, from overhead.py's fixed SGLang-shaped bodies."""
    b = worker_bodies("regular", 1, None)
    bodies = {
        b"/health": b"",
        b"/health_generate": b"",
        b"/flush_cache": b"",
        b"/server_info": b["SERVER_INFO"],
        b"/get_server_info": b["SERVER_INFO"],
        b"/model_info": b["MODEL_INFO"],
        b"/get_model_info": b["MODEL_INFO"],
        b"/v1/models": b["MODELS"],
        b"/v1/loads": b["LOADS"],
        b"/get_load": b["GET_LOAD"],
    }
    out = {}
    for path, body in bodies.items():
        data = body.encode() if isinstance(body, str) else body
        out[path] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
            len(data),
            data,
        )
    return out


class _Backend(asyncio.Protocol):
    """One connection to the slow backend: fixed GET answers, endless slow SSE for POSTs."""

    def __init__(self, answers: dict[bytes, bytes], streams: set[Any]) -> None:
        self.answers = answers
        self.streams = streams
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.url = b""
        self.sent = 0

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.streams.discard(self)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        path = self.url.partition(b"?")[0]
        self.url = b""
        if self.parser.get_method() == b"POST" and path == SSE_PATH.encode():
            self.transport.write(_SSE_HEAD + _event(0))
            self.sent = 1
            self.streams.add(self)
            return
        ans = self.answers.get(path)
        if ans is None:
            ans = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
        self.transport.write(ans)


async def _backend_main(port: int, interval: float) -> None:
    loop = asyncio.get_running_loop()
    answers = _answers()
    streams: set[_Backend] = set()
    server = await loop.create_server(lambda: _Backend(answers, streams), "127.0.0.1", port, backlog=4096)
    # One timer for every stream: each gets its next event once per interval.
    while True:
        await asyncio.sleep(interval)
        for s in list(streams):
            if not s.transport.is_closing():
                s.transport.write(_event(s.sent))
                s.sent += 1
    server.close()


# ----------------------------------------------------------------------------- client


def _request(i: int, prompt_bytes: int, port: int) -> bytes:
    text = f"memory benchmark stream {i}: " + "count slowly, one word at a time. " * 400
    body = json.dumps(
        {
            "model": MODEL,
            "stream": True,
            "max_tokens": 100000,
            "messages": [{"role": "user", "content": text[:prompt_bytes]}],
        },
        separators=(",", ":"),
    ).encode()
    return (
        b"POST %b HTTP/1.1\r\nHost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (SSE_PATH.encode(), port, len(body), body)
    )


class _Stream(asyncio.Protocol):
    """One client stream: send the request, read the head and count ``data:`` events."""

    def __init__(self, request: bytes, first: asyncio.Future) -> None:
        self.request = request
        self.first = first
        self.transport: Any = None
        self.buf = b""
        self.status = 0
        self.events = 0
        self.closed = False
        self.error = ""

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.status == 0:
            self.buf += data
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            try:
                self.status = int(self.buf.split(b" ", 2)[1])
            except (IndexError, ValueError):
                self.status = -1
            data = self.buf[end + 4 :]
            self.buf = b""
            if self.status != 200:
                self.error = "status %d" % self.status
                self._settle()
                return
        # "data: " may straddle two reads: keep the last 5 bytes of the previous one.
        joined = self.buf + data
        self.events += joined.count(b"data: ")
        self.buf = joined[-5:]
        if self.events and not self.first.done():
            self.first.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.error:
            self.error = "closed by the router" + (f" ({exc})" if exc else "")
        self._settle()

    def _settle(self) -> None:
        if not self.first.done():
            self.first.set_result(None)


async def _open_streams(n: int, port: int, prompt_bytes: int, batch: int, timeout: float) -> list[_Stream]:
    """Open n streams through the router (``batch`` connects at a time), held open; return when
    every one has its first event (or failed, or the timeout passed)."""
    loop = asyncio.get_running_loop()
    streams: list[_Stream] = []
    for start in range(0, n, batch):
        group = []
        for i in range(start, min(n, start + batch)):
            s = _Stream(_request(i, prompt_bytes, port), loop.create_future())
            streams.append(s)
            group.append(loop.create_connection(lambda s=s: s, "127.0.0.1", port))
        for res in await asyncio.gather(*group, return_exceptions=True):
            if isinstance(res, BaseException):
                raise SystemExit(f"connect to the router failed: {res!r}")
    try:
        await asyncio.wait_for(asyncio.gather(*(s.first for s in streams)), timeout)
    except asyncio.TimeoutError:
        pass
    return streams


def _check(streams: list[_Stream], what: str) -> None:
    bad = [s for s in streams if s.error or s.status != 200 or s.events == 0]
    if bad:
        kinds: dict[str, int] = {}
        for s in bad:
            k = s.error or ("no head" if s.status == 0 else "no event")
            kinds[k] = kinds.get(k, 0) + 1
        raise SystemExit(f"{what}: {len(bad)} of {len(streams)} streams failed: {kinds}")


# ----------------------------------------------------------------------------- /proc


def proc_kb(pid: int, key: str) -> int:
    """A ``kB`` line of /proc/PID/status (VmRSS, VmHWM, ...)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "?"
    return " ".join(" ".join([os.path.basename(argv[0])] + argv[1:]).split())


# ----------------------------------------------------------------------------- run


def wait_ready(port: int, proc: Any, timeout: float = 60.0) -> None:
    """GET /readiness until 200 (the backend is registered as a worker)."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"router exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readiness", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise SystemExit(f"router not ready after {timeout:.0f}s: {last}")


def raise_nofile(need: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        soft = min(need, hard) if hard != resource.RLIM_INFINITY else need
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft < need:
        raise SystemExit(
            f"RLIMIT_NOFILE hard limit {hard} is below the {need} descriptors this "
            "run needs (raise it with ulimit -Hn as root)"
        )
    return soft


async def measure(n: int, args: argparse.Namespace, procs: Procs, backend_url: str) -> dict[str, Any]:
    port, prom = free_port(), free_port()
    argv = [
        sys.executable,
        "-m",
        "fastroute",
        "--worker-urls",
        backend_url,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(prom),
        *args.router_args,
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    name = f"router-{n}"
    proc = procs.start(name, argv, env=env, cwd=REPO)
    try:
        await asyncio.to_thread(wait_ready, port, proc)
        await asyncio.sleep(1.0)  # let the first load poll and start-up allocations settle
        pid = proc.pid
        idle = proc_kb(pid, "VmRSS")
        t0 = time.monotonic()
        streams = await _open_streams(n, port, args.prompt_bytes, args.batch, timeout=max(30.0, n / 100))
        opened = time.monotonic() - t0
        _check(streams, f"N={n}, first event")
        before = [s.events for s in streams]
        held: list[int] = []
        end = time.monotonic() + args.hold
        while time.monotonic() < end:
            held.append(proc_kb(pid, "VmRSS"))
            await asyncio.sleep(0.25)
        if proc.poll() is not None:
            raise SystemExit(f"router exited with code {proc.returncode} while holding {n} streams")
        _check(streams, f"N={n}, after the hold window")
        if args.hold >= 2 * args.interval:
            stalled = sum(1 for s, b in zip(streams, before) if s.events <= b)
            if stalled:
                raise SystemExit(f"N={n}: {stalled} streams got no event in the {args.hold}s window")
        peak = proc_kb(pid, "VmHWM")
        kids = {c: (cmdline(c), proc_kb(c, "VmRSS")) for c in children(pid)}
        for s in streams:
            s.transport.abort()
        # After the streams: the pool keeps their upstream connections idle up to its timeout.
        await asyncio.sleep(args.settle)
        after = proc_kb(pid, "VmRSS")
        return {
            "n": n,
            "idle": idle,
            "held": max(held),
            "peak": peak,
            "after": after,
            "per_stream": (peak - idle) * 1024 / n,
            "open_s": opened,
            "events": sum(s.events for s in streams),
            "children": kids,
        }
    finally:
        procs.stop(name)


def mb(kb: int) -> str:
    return f"{kb / 1024:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| streams | idle RSS (MB) | RSS held (MB) | peak RSS (MB) | (peak - idle) / stream (KB) "
        "| RSS after close (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['n']:,} | {mb(r['idle'])} | {mb(r['held'])} | {mb(r['peak'])} "
            f"| {r['per_stream'] / 1024:.1f} | {mb(r['after'])} |"
        )
    return "\n".join(out)


async def run(args: argparse.Namespace) -> str:
    top = max(args.streams)
    # This process holds N client sockets; the router 2N (+ its own); the backend N. Children
    # inherit the raised soft limit (fastroute does not raise its own).
    raise_nofile(FDS_PER_STREAM * top + 256)
    tmp = Path(tempfile.mkdtemp(prefix="fr-membench-"))
    procs = Procs(tmp)
    rows = []
    try:
        bport = free_port()
        backend = procs.start(
            "backend",
            [sys.executable, str(Path(__file__).resolve()), "--backend", str(bport), "--interval", str(args.interval)],
            cwd=REPO,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{bport}/health", timeout=1):
                    break
            except OSError:
                if backend.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("backend did not start:\n" + procs.log_tail("backend")) from None
                time.sleep(0.1)
        for n in args.streams:
            r = await measure(n, args, procs, f"http://127.0.0.1:{bport}")
            rows.append(r)
            print(
                f"N={n}: idle {mb(r['idle'])} MB, peak {mb(r['peak'])} MB, "
                f"{r['per_stream'] / 1024:.1f} KB/stream, opened in {r['open_s']:.1f}s, "
                f"{r['events']} events; children: "
                + (", ".join(f"{c} {mb(k)} MB ({cmd[:60]})" for c, (cmd, k) in r["children"].items()) or "none"),
                file=sys.stderr,
                flush=True,
            )
    finally:
        procs.stop_all()
    cmd = "python bench/memory.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    lines = [
        table(rows),
        "",
        f"`{cmd.strip()}`: one fresh router per row (regular mode, default flags"
        + (f" + `{' '.join(args.router_args)}`" if args.router_args else "")
        + f"), one slow backend (one event per {args.interval:g} s per stream), "
        f"{args.prompt_bytes}-byte prompts, RSS of the router process from /proc "
        f'(peak = VmHWM), held for {args.hold:g} s, "after close" {args.settle:g} s after '
        "the clients left.",
    ]
    kids: dict[str, int] = {}
    for r in rows:
        for cmd, kb in r["children"].values():
            kids[cmd] = max(kids.get(cmd, 0), kb)
    if kids:
        lines.append(
            "Child processes of the router, not counted above: "
            + "; ".join(f"`{cmd[:70]}` {mb(kb)} MB" for cmd, kb in sorted(kids.items()))
            + "."
        )
    return "\n".join(lines)


def _shape(argv: list[str]) -> str:
    """The --shape value in argv ("chat" when absent)."""
    for i, a in enumerate(argv):
        if a == "--shape" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--shape="):
            return a.split("=", 1)[1]
    return "chat"


def main() -> None:
    if _shape(sys.argv[1:]) == "generate":
        # N /generate streams with ~2 KB texts from an aiohttp client through an aiohttp
        # worker, P2C on request counts: bench/memory_generate.py, with its own options.
        import memory_generate

        raise SystemExit(memory_generate.main(sys.argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--shape",
        choices=("chat", "generate"),
        default="chat",
        help="chat: this benchmark (SSE chat streams, short prompts); generate: N /generate streams "
        "of ~2 KB texts held by an aiohttp client (bench/memory_generate.py; its options: --streams N "
        "--events 10 --gap 0.5 --text-bytes 2048 --out FILE)",
    )
    ap.add_argument("--streams", type=int, nargs="+", default=[1000, 2000, 5000])
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between a stream's events")
    ap.add_argument("--hold", type=float, default=5.0, help="seconds the N streams are held and sampled")
    ap.add_argument(
        "--settle", type=float, default=5.0, help="seconds after the clients left before the last RSS reading"
    )
    ap.add_argument("--prompt-bytes", type=int, default=200, help="user message length per request")
    ap.add_argument("--batch", type=int, default=250, help="connections opened at a time")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "memory.md")
    ap.add_argument("--backend", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("router_args", nargs="*", help="extra fastroute flags (after --)")
    args = ap.parse_args()
    if args.backend is not None:
        try:
            uvloop.run(_backend_main(args.backend, args.interval))
        except KeyboardInterrupt:
            pass
        return
    report = uvloop.run(run(args))
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
