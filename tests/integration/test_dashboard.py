"""GET /dashboard on the metrics listener while the simulated PD cluster serves traffic: the page
is self-contained, its event stream carries every rank, and headless Chromium (Debian's
``chromium``, driven over the DevTools protocol) shows every rank and updates; its screenshot is
saved under the test's output directory."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import aiohttp
import pytest

from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection, fetch
from fastroute.sim.worker import start_cluster
from tests.integration.conftest import Router, run, until
from tests.integration.test_multiproc import MultiRouter, per_process

H = "127.0.0.1"
SIM = SimParams(dp_size=3, time_scale=0.05)
# The prefill keeps a prefix cache per rank and reports its hit rate in /v1/loads.
PREFILL = SimParams(dp_size=3, time_scale=0.05, prefix_cache_tokens=200_000, prefix_block_tokens=16)
SHARED = "You are a helpful assistant. Answer briefly. " * 30  # every prompt's common prefix
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _router(cluster) -> Router:
    p, d = cluster.prefills[0], cluster.decodes[0]
    return Router(
        pd_disaggregation=True,
        prefill=[(p.url, p.bootstrap_port)],
        decode=[d.url],
        dp_aware=True,
        policy="cache_aware",
        load_monitor_interval=0.2,
    )


@contextlib.asynccontextmanager
async def traffic(port: int, n: int = 4):
    """``n`` clients sending requests to the router in a loop until the block ends."""
    stop = asyncio.Event()

    async def client(k: int) -> None:
        i = 0
        while not stop.is_set():
            conn = HttpConnection(H, port)
            try:
                body = {"text": SHARED + "client %d request %d" % (k, i), "sampling_params": {"max_new_tokens": 8}}
                await conn.request("POST", "/generate", json.dumps(body).encode())
            finally:
                conn.close()
            i += 1

    tasks = [asyncio.ensure_future(client(k)) for k in range(n)]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)


def _names(r: Router) -> set[str]:
    return {f"{w.url}@{rank}" for w, rank in (e for e in r.server.registry.target_info if e is not None)}


async def _events(port: int, count: int) -> list[dict]:
    """The first ``count`` snapshots of /dashboard/events."""
    reader, writer = await asyncio.open_connection(H, port)
    try:
        writer.write(b"GET /dashboard/events HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
        out = []
        while len(out) < count:
            line = await asyncio.wait_for(reader.readuntil(b"\n\n"), 10)
            assert line.startswith(b"data: ")
            out.append(json.loads(line[6:]))
        return out
    finally:
        writer.close()


def test_the_page_is_self_contained_and_the_stream_carries_every_rank() -> None:
    async def go() -> None:
        cluster = await start_cluster(1, 1, SIM, PREFILL)
        try:
            async with _router(cluster) as r, traffic(r.port):
                mport = r.server.metrics.port
                status, page = await fetch(H, mport, "GET", "/dashboard")
                assert status == 200 and page.startswith(b"<!doctype html>")
                # Nothing to fetch from anywhere: no external script, style, font or image.
                for ref in (b"src=", b"<link", b"@import", b"url(", b"http://", b"https://"):
                    assert ref not in page, ref
                await until(lambda: r.server.table.snapshot()[:, 7].sum() > 10, 20.0, "traffic picked")
                pe = cluster.prefills[0].url
                await until(
                    lambda: any(v.get("cache_hit_rate", 0) > 0.5 for _, v in r.server.monitor.engine.rows.get(pe, [])),
                    20.0,
                    "a load poll reporting prefix hits",
                )
                a, b = await _events(mport, 2)
                shown = {f"{w['url']}@{x['rank']}" for w in a["workers"] for x in w["ranks"]}
                assert shown == _names(r) and len(shown) == 6
                assert len(a["history"]) >= 1 and b["seq"] == a["seq"] + 1 and "history" not in b
                assert all(k.startswith(("prefill/", "decode/")) for k in b["decisions_per_s"])
                assert sum(b["decisions_per_s"].values()) > 0
                # The engines' own per-rank prefix hit rate, from the load polls.
                (pw,) = [w for w in b["workers"] if w["role"] == "prefill"]
                assert all(x["hit_rate"] is not None for x in pw["ranks"])
                assert max(x["hit_rate"] for x in pw["ranks"]) > 0.5, pw
        finally:
            await cluster.stop()

    run(go(), 60.0)


def test_workers_n_the_supervisor_shows_every_process_picks() -> None:
    """--workers 2: the page's snapshot on the supervisor's metrics port holds the picks and the
    pick reasons of both proxy processes (the shared table, the children's shipped decisions)."""

    async def go() -> None:
        cluster = await start_cluster(1, 1, SIM, PREFILL)
        p, d = cluster.prefills[0], cluster.decodes[0]
        try:
            async with MultiRouter(
                "--pd-disaggregation",
                "--prefill",
                p.url,
                str(p.bootstrap_port),
                "--decode",
                d.url,
                "--dp-aware",
                "--policy",
                "cache_aware",
            ) as r:
                async with traffic(r.port, 6):
                    m = await r.until_metric(
                        lambda m: (
                            len(per_process(m, "fastroute_proxy_process_picks_total")) == 2
                            and min(per_process(m, "fastroute_proxy_process_picks_total").values()) > 0
                        ),
                        30.0,
                        "both proxy processes picking",
                    )
                    children = per_process(m, "fastroute_proxy_process_picks_total")
                    a, b = await _events(r.mport, 2)
                shown = {f"{w['url']}@{x['rank']}" for w in a["workers"] for x in w["ranks"]}
                assert shown == {f"{u}@{k}" for u in (p.url, d.url) for k in range(3)}
                picks = sum(x["picks"] for w in b["workers"] for x in w["ranks"])
                assert picks >= sum(children.values())  # both processes' picks, not the supervisor's none
                reasons = {k.split("/")[1] for k in b["decisions_per_s"]}
                assert reasons and reasons <= {"prefix_hit", "prefix_miss", "load", "prefix_blocks"}, b
        finally:
            await cluster.stop()

    run(go(), 90.0)


class DevTools:
    """Headless Chromium and one page, over the DevTools protocol (its websocket)."""

    def __init__(self, out_dir: Path) -> None:
        self.profile = tempfile.mkdtemp(prefix="fastroute-chromium-")
        args = [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--window-size=1200,900",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
            f"--user-data-dir={self.profile}",
            "about:blank",
        ]
        self.log = open(out_dir / "chromium.log", "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.session: aiohttp.ClientSession | None = None
        self.ws = None
        self.seq = 0

    async def open(self) -> None:
        port_file = Path(self.profile) / "DevToolsActivePort"
        await until(port_file.exists, 30.0, "Chromium's DevTools port")
        await until(lambda: len(port_file.read_text().split()) >= 2, 5.0, "the port file written")
        port = int(port_file.read_text().split()[0])
        self.session = aiohttp.ClientSession()
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as resp:
            pages = [t for t in await resp.json() if t["type"] == "page"]
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)

    async def call(self, method: str, **params) -> dict:
        self.seq += 1
        mid = self.seq
        await self.ws.send_json({"id": mid, "method": method, "params": params})
        while True:
            msg = await asyncio.wait_for(self.ws.receive_json(), 30)
            if msg.get("id") == mid:
                assert "error" not in msg, msg
                return msg["result"]

    async def eval(self, expr: str):
        res = await self.call("Runtime.evaluate", expression=expr, returnByValue=True)
        return res["result"].get("value")

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.profile, ignore_errors=True)


_ROWS = (
    "JSON.stringify([...document.querySelectorAll('.rank[data-target]')].map(r => [r.dataset.target, r.textContent]))"
)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium; .ci/run does)")
def test_chromium_shows_every_rank_and_the_view_updates(tmp_path: Path) -> None:
    async def go() -> None:
        cluster = await start_cluster(1, 1, SIM, PREFILL)
        browser = DevTools(tmp_path)
        try:
            async with _router(cluster) as r, traffic(r.port):
                await browser.open()
                await browser.call("Page.enable")
                await browser.call("Page.navigate", url=f"http://127.0.0.1:{r.server.metrics.port}/dashboard")
                names = _names(r)
                rows: list = []

                async def shown() -> bool:
                    rows[:] = json.loads(await browser.eval(_ROWS) or "[]")
                    return {t for t, _ in rows} == names

                for _ in range(300):
                    if await shown():
                        break
                    await asyncio.sleep(0.1)
                assert {t for t, _ in rows} == names, rows
                first = list(rows)
                seq0 = await browser.eval("document.getElementById('seq').textContent")
                for _ in range(300):  # the next snapshots arrive over SSE, with new picks
                    await shown()
                    seq = await browser.eval("document.getElementById('seq').textContent")
                    if seq != seq0 and rows != first:
                        break
                    await asyncio.sleep(0.1)
                assert seq != seq0 and rows != first, (first, rows)
                assert await browser.eval("document.getElementById('state').textContent") == "live"
                shot = await browser.call("Page.captureScreenshot", format="png")
                png = tmp_path / "dashboard.png"
                png.write_bytes(base64.b64decode(shot["data"]))
                assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
                print(f"dashboard screenshot: {png}")
                if os.environ.get("FASTROUTE_SCREENSHOT_DIR"):
                    shutil.copy(png, Path(os.environ["FASTROUTE_SCREENSHOT_DIR"]) / "dashboard.png")
        finally:
            await browser.close()
            await cluster.stop()

    run(go(), 120.0)
