"""GET /dashboard on the MAIN port (issue 48): the page is served to a browser without a key
(it holds no data), its snapshots (``GET /dashboard/snapshot``) only with an admin key where an
admin rule is configured; the page polls them with the key it asked for once. Real router, real
simulated PD cluster, real sockets; headless Chromium where installed."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
from pathlib import Path

import aiohttp
import pytest

from fastroute.sim.worker import start_cluster
from tests.integration.conftest import Router, run, until
from tests.integration.test_dashboard import CHROMIUM, PREFILL, SIM, DevTools, _names, traffic
from tests.integration.test_multiproc import MultiRouter, per_process

H = "127.0.0.1"
ADMIN, USER = "adm-secret-48", "usr-secret-48"
KEYS = [f"a1:ops:admin:{ADMIN}", f"u1:viewer:user:{USER}"]


async def _get(port: int, path: str, key: str | None = None) -> tuple[int, str, bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    async with aiohttp.ClientSession() as s, s.get(f"http://{H}:{port}{path}", headers=headers) as resp:
        return resp.status, resp.headers.get("Content-Type", ""), await resp.read()


def _shown(snap: dict) -> set[str]:
    return {f"{w['url']}@{x['rank']}" for w in snap["workers"] for x in w["ranks"]}


def _with(cluster, **cfg) -> Router:
    p, d = cluster.prefills[0], cluster.decodes[0]
    return Router(
        pd_disaggregation=True,
        prefill=[(p.url, p.bootstrap_port)],
        decode=[d.url],
        dp_aware=True,
        policy="cache_aware",
        load_monitor_interval=0.2,
        **cfg,
    )


def test_main_port_snapshot_needs_an_admin_key_and_shows_every_rank() -> None:
    async def go() -> None:
        cluster = await start_cluster(1, 1, SIM, PREFILL)
        try:
            async with _with(cluster, control_plane_api_keys=KEYS) as r, traffic(r.port):
                # The page: served without a key (a browser cannot send one when it opens a URL),
                # self-contained, and set to poll the snapshot instead of the SSE stream.
                status, ctype, page = await _get(r.port, "/dashboard")
                assert status == 200 and ctype.startswith("text/html") and page.startswith(b"<!doctype html>")
                assert b'data-feed="poll"' in page
                for ref in (b"src=", b"<link", b"@import", b"url(", b"http://", b"https://"):
                    assert ref not in page, ref
                # The snapshot: no key, a wrong key -> 401; a user-role key -> 403; JSON reasons.
                for key, want in ((None, 401), ("not-a-key", 401), (USER, 403)):
                    status, ctype, body = await _get(r.port, "/dashboard/snapshot", key)
                    assert status == want and ctype.startswith("application/json"), (key, status, body)
                    assert json.loads(body)["error"]["message"], body
                await until(lambda: r.server.table.snapshot()[:, 7].sum() > 10, 20.0, "traffic picked")
                status, _, body = await _get(r.port, "/dashboard/snapshot?history=1", ADMIN)
                assert status == 200, body
                a = json.loads(body)
                assert _shown(a) == _names(r) and len(_shown(a)) == 6
                assert len(a["history"]) >= 1
                b: dict = {}

                async def moved() -> bool:
                    status, _, body = await _get(r.port, "/dashboard/snapshot", ADMIN)
                    assert status == 200, body
                    b.update(json.loads(body))
                    return b["seq"] > a["seq"] and b["workers"] != a["workers"]

                for _ in range(100):
                    if await moved():
                        break
                    await asyncio.sleep(0.2)
                assert b["seq"] > a["seq"] and b["workers"] != a["workers"], (a, b)
                assert "history" not in b and _shown(b) == _names(r)
                assert sum(x["picks"] for w in b["workers"] for x in w["ranks"]) > 0
                # The engines' own per-rank prefix hit rate reaches this view too (the monitor).
                pe = cluster.prefills[0].url
                await until(
                    lambda: any(v.get("cache_hit_rate", 0) > 0 for _, v in r.server.monitor.engine.rows.get(pe, [])),
                    20.0,
                    "a load poll reporting prefix hits",
                )
                status, _, body = await _get(r.port, "/dashboard/snapshot", ADMIN)
                (pw,) = [w for w in json.loads(body)["workers"] if w["role"] == "prefill"]
                assert any(x["hit_rate"] is not None for x in pw["ranks"]), pw
        finally:
            await cluster.stop()

    run(go(), 60.0)


def test_main_port_snapshot_api_key_no_rule_and_closed() -> None:
    """--api-key alone guards the snapshot; with no admin rule at all it is served like the
    other admin reads in that mode; with the admin routes closed it is refused."""

    async def go() -> None:
        cluster = await start_cluster(1, 1, SIM, PREFILL)
        try:
            async with _with(cluster, api_key="data-key-48") as r:
                assert (await _get(r.port, "/dashboard/snapshot"))[0] == 401
                assert (await _get(r.port, "/dashboard/snapshot", "wrong"))[0] == 401
                status, _, body = await _get(r.port, "/dashboard/snapshot", "data-key-48")
                assert status == 200 and _shown(json.loads(body)) == _names(r)
                assert (await _get(r.port, "/dashboard"))[0] == 200
            async with _with(cluster) as r:
                status, _, body = await _get(r.port, "/dashboard/snapshot")
                assert status == 200 and _shown(json.loads(body)) == _names(r)
            # Admin routes closed (fastroute sidecar without keys): no key can open the data.
            async with _with(cluster, admin_closed=True) as r:
                for key in (None, "anything"):
                    status, _, body = await _get(r.port, "/dashboard/snapshot", key)
                    assert status == 403 and json.loads(body)["error"]["code"] == "admin_api_closed", body
                assert (await _get(r.port, "/dashboard"))[0] == 200
        finally:
            await cluster.stop()

    run(go(), 60.0)


def test_workers_n_every_process_shows_every_rank_on_the_main_port() -> None:
    """--workers 2 with control-plane keys: whichever proxy process answers, its snapshot holds
    every rank of the shared table; a user key is refused there too."""

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
                "--control-plane-api-keys",
                *KEYS,
            ) as r:
                want = {f"{u}@{k}" for u in (p.url, d.url) for k in range(3)}
                async with traffic(r.port, 4):
                    m = await r.until_metric(
                        lambda m: (
                            len(per_process(m, "fastroute_proxy_process_picks_total")) == 2
                            and min(per_process(m, "fastroute_proxy_process_picks_total").values()) > 0
                        ),
                        30.0,
                        "both proxy processes picking",
                    )
                    children = per_process(m, "fastroute_proxy_process_picks_total")
                    for _ in range(8):  # fresh connections: both processes answer some
                        assert (await _get(r.port, "/dashboard/snapshot", USER))[0] == 403
                        status, _, body = await _get(r.port, "/dashboard/snapshot", ADMIN)
                        assert status == 200, body
                        snap = json.loads(body)
                        assert _shown(snap) == want
                        # The shared table's picks: both processes', not only the answering one's.
                        assert sum(x["picks"] for w in snap["workers"] for x in w["ranks"]) >= sum(children.values())
        finally:
            await cluster.stop()

    run(go(), 90.0)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (Debian: apt-get install chromium; .ci/run does)")
def test_chromium_main_port_asks_for_the_key_then_shows_every_rank(tmp_path: Path) -> None:
    async def go() -> None:
        cluster = await start_cluster(1, 1, SIM, PREFILL)
        browser = DevTools(tmp_path)
        try:
            async with _with(cluster, control_plane_api_keys=KEYS) as r, traffic(r.port):
                await browser.open()
                await browser.call("Page.enable")
                await browser.call("Page.navigate", url=f"http://127.0.0.1:{r.port}/dashboard")
                ask = "document.getElementById('keybox').hidden === false"
                for _ in range(100):  # refused without a key: the page asks for one
                    if await browser.eval(ask):
                        break
                    await asyncio.sleep(0.1)
                assert await browser.eval(ask)
                assert (await browser.eval("document.getElementById('state').textContent")) == "refused (401)"
                # Type the key into the form and submit it, as an operator would.
                await browser.eval(
                    "document.getElementById('key').value = %s;"
                    "document.getElementById('keybox').requestSubmit(); true" % json.dumps(ADMIN)
                )
                names = _names(r)
                rows: list = []

                async def shown() -> bool:
                    rows[:] = json.loads(
                        await browser.eval(
                            "JSON.stringify([...document.querySelectorAll('.rank[data-target]')]"
                            ".map(r => [r.dataset.target, r.textContent]))"
                        )
                        or "[]"
                    )
                    return {t for t, _ in rows} == names

                for _ in range(300):
                    if await shown():
                        break
                    await asyncio.sleep(0.1)
                assert {t for t, _ in rows} == names, rows
                first = list(rows)
                seq0 = await browser.eval("document.getElementById('seq').textContent")
                for _ in range(300):
                    await shown()
                    seq = await browser.eval("document.getElementById('seq').textContent")
                    if seq != seq0 and rows != first:
                        break
                    await asyncio.sleep(0.1)
                assert seq != seq0 and rows != first, (first, rows)
                assert await browser.eval("document.getElementById('state').textContent") == "live"
                # The key is kept for the tab, never put in the URL.
                assert await browser.eval("sessionStorage.getItem('fastroute-admin-key')") == ADMIN
                assert ADMIN not in await browser.eval("location.href")
                shot = await browser.call("Page.captureScreenshot", format="png")
                png = tmp_path / "dashboard-main.png"
                png.write_bytes(base64.b64decode(shot["data"]))
                print(f"dashboard screenshot: {png}")
                if os.environ.get("FASTROUTE_SCREENSHOT_DIR"):
                    shutil.copy(png, Path(os.environ["FASTROUTE_SCREENSHOT_DIR"]) / "dashboard-main.png")
        finally:
            await browser.close()
            await cluster.stop()

    run(go(), 120.0)
