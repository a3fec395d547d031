"""Who may be a worker (a router that proxies to itself loops; a link-local address reaches
cloud metadata): never the router itself, under any alias and
whoever adds it (admin API, legacy API, manifest discovery, command line); never a malformed URL
or (without --allow-link-local-workers) a link-local address. Refusals are 409 / 400 with a JSON
reason, and the registry is left as it was."""

from __future__ import annotations

import json
import logging
import socket
from urllib.parse import quote

import pytest
from conftest import Router, call, get, post, run, until, workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def interface_address() -> str | None:
    """An address of this host's interfaces other than loopback (None when there is none)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: no packet is sent by a UDP connect
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


def aliases(port: int) -> list[str]:
    out = [
        f"http://127.0.0.1:{port}",
        f"http://127.3.4.5:{port}",
        f"http://localhost:{port}",
        f"http://0.0.0.0:{port}",
        f"http://[::1]:{port}",
        f"http://0x7f000001:{port}",
        f"http://2130706433:{port}",
        f"http://127.1:{port}",
        f"http://[::ffff:127.0.0.1]:{port}",
        f"127.0.0.1:{port}",
        f"HTTP://LOCALHOST:{port}/",
    ]
    ip = interface_address()
    if ip is not None:
        out.append(f"http://{ip}:{port}")
    return out


async def add(port: int, url: str, headers: dict[str, str] | None = None):
    return await call(port, post("/workers", {"url": url}, headers))


def test_router_refuses_itself_as_a_worker_on_every_port_and_alias() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        probe = free_port()
        async with Router(worker_urls=[w.url], host="0.0.0.0", health_check_port=probe, prometheus_host="0.0.0.0") as r:
            reg = r.server.registry
            for port in (r.port, r.server.metrics.port, probe):
                for url in aliases(port):
                    res = await add(r.port, url)
                    assert res.status == 409, (url, res.status, res.body)
                    err = res.json["error"]
                    assert err["code"] == "worker_is_router" and "this router" in err["message"]
                legacy = await call(
                    r.port,
                    f"POST /add_worker?url=http://localhost:{port} HTTP/1.1\r\n"
                    "Host: x\r\nContent-Length: 0\r\n\r\n".encode(),
                )
                assert legacy.status == 409 and legacy.json["error"]["code"] == "worker_is_router"
            assert [x.url for x in reg.workers] == [w.url]
            # Another port on loopback is not the router: accepted (queued).
            other = await add(r.port, f"http://127.0.0.1:{free_port()}")
            assert other.status == 202, other.body
            res = await call(r.port, post("/generate", {"text": "still routes"}))
            assert res.status == 200
        await w.stop()

    run(body())


def test_a_router_bound_to_one_address_refuses_that_address_only() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:  # host 127.0.0.1
            assert (await add(r.port, f"http://127.0.0.1:{r.port}")).status == 409
            assert (await add(r.port, f"http://localhost:{r.port}")).status == 409
            # 127.0.0.2 is another socket than 127.0.0.1's: a worker may live there.
            assert (await add(r.port, f"http://127.0.0.2:{r.port}")).status == 202
        await w.stop()

    run(body())


def test_manifest_entry_that_is_the_router_is_skipped_and_logged_once(tmp_path, caplog) -> None:
    async def body() -> None:
        w, w2, w3 = await workers(3)
        path = tmp_path / "workers.json"
        async with Router(worker_urls=[w.url], discovery_provider="file", discovery_file=str(path)) as r:
            me = f"http://localhost:{r.port}"
            reg = r.server.registry

            def ready(*ws) -> bool:
                return {x.url for x in reg.workers if x.status == "ready"} == {v.url for v in ws}

            path.write_text(json.dumps([{"url": me}, {"url": w2.url}]))
            await until(lambda: ready(w, w2), 10.0, "manifest worker registered")
            # Re-read with the same entry (and a new worker, which shows it was applied).
            path.write_text(json.dumps([{"url": w2.url}, {"url": me}, {"url": w3.url}]))
            await until(lambda: ready(w, w2, w3), 10.0, "manifest re-read")
            assert len(reg.workers) == 3
            res = await call(r.port, post("/generate", {"text": "hi"}))
            assert res.status == 200
        assert sum("this router" in m.getMessage() for m in caplog.records) == 1
        for x in (w, w2, w3):
            await x.stop()

    with caplog.at_level(logging.INFO, logger="fastroute.discovery"):
        run(body(), 60)


def test_command_line_worker_that_is_the_router_is_not_registered(caplog) -> None:
    async def body() -> None:
        port = free_port()
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url, f"http://localhost:{port}"], port=port) as r:
            assert [x.url for x in r.server.registry.workers] == [w.url]
        await w.stop()

    with caplog.at_level(logging.ERROR, logger="fastroute.workers"):
        run(body())
    assert any("this router" in m.getMessage() for m in caplog.records)


BAD_URLS = [
    pytest.param("ftp://w:1", id="scheme-ftp"),
    pytest.param("file:///etc/passwd", id="scheme-file"),
    pytest.param("http://w:1/\ncontrol_plane_audit key=admin outcome=success", id="newline"),
    pytest.param("http://w:1\r", id="cr"),
    pytest.param("http://w :1", id="space"),
    pytest.param("http://w:1/\x00", id="nul"),
    pytest.param("http://w\t:1", id="tab"),
    pytest.param("http://w:1/\ud800", id="lone-surrogate"),
    pytest.param("http://bücher.example:1", id="non-ascii-host"),
    pytest.param("http://w:1/\u2028", id="line-separator"),
    pytest.param("http://w:0", id="port-0"),
    pytest.param("http://w:65536", id="port-65536"),
    pytest.param("http://w:", id="port-empty"),
    pytest.param("http://w:8x", id="port-junk"),
    pytest.param("http://" + "a" * 254, id="host-254"),
    pytest.param("http://" + ".".join(["a" * 63] * 4) + "b", id="host-256-labels"),
    pytest.param("http://-bad-.example:1", id="host-dash"),
    pytest.param("http://a..b:1", id="host-empty-label"),
    pytest.param("http://[::1:1", id="ipv6-unterminated"),
    pytest.param("http://[zz::1]:1", id="ipv6-junk"),
    pytest.param("http://:80", id="no-host"),
    pytest.param("http://169.254.169.254", id="metadata"),
    pytest.param("http://169.254.1.1:8000", id="link-local-v4"),
    pytest.param("http://[fe80::1]:8000", id="link-local-v6"),
    pytest.param("http://0xa9fea9fe:80", id="metadata-hex"),
    pytest.param("http://[::ffff:169.254.169.254]:80", id="metadata-mapped"),
    pytest.param("http://w:1/" + "a" * 10_000, id="long-path"),
]


@pytest.mark.parametrize("url", BAD_URLS)
def test_bad_worker_urls_are_400_json_and_change_nothing(url: str, caplog) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], control_plane_audit_enabled=True) as r:
            res = await add(r.port, url)
            assert res.status == 400, res.body
            assert res.json["error"]["code"] == "bad_request" and "worker URL" in res.json["error"]["message"]
            target = quote(url, errors="surrogatepass")
            legacy = await call(
                r.port, f"POST /add_worker?url={target} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()
            )
            assert legacy.status == 400 and legacy.json["error"]["code"] == "bad_request"
            assert [x.url for x in r.server.registry.workers] == [w.url]
            assert (await call(r.port, post("/generate", {"text": "hi"}))).status == 200
        await w.stop()

    with caplog.at_level(logging.INFO):
        run(body())
    # Nothing forged reaches the log: no record carries a line break taken from the URL.
    assert not any("\n" in m.getMessage() for m in caplog.records if m.name in ("fastroute.audit", "fastroute.workers"))


def test_link_local_workers_need_the_flag() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], allow_link_local_workers=True, worker_startup_timeout_secs=1) as r:
            res = await add(r.port, "http://169.254.1.1:8000")
            assert res.status == 202, res.body
            listed = await call(r.port, get("/workers"))
            assert "http://169.254.1.1:8000" in [x["url"] for x in listed.json["workers"]]
        await w.stop()

    run(body())


def test_good_urls_still_accepted() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], worker_startup_timeout_secs=1) as r:
            for url in (
                "http://w.example:1",
                "https://[2001:db8::1]:8443/",
                "w2.example:30000",
                "http://user:pw@w3.example:1",
                "http://under_score.svc:1",
            ):
                res = await add(r.port, url)
                assert res.status == 202, (url, res.body)
        await w.stop()

    run(body())


def test_workers_n_supervisor_refuses_itself_too() -> None:
    """Under --workers 2 the supervisor owns the registry: a proxy process forwards the
    change, and the supervisor knows the shared port and its control listener."""
    import asyncio
    import os
    import sys

    async def body() -> None:
        (w,) = await workers(1)
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fastroute",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            w.url,
            "--policy",
            "round_robin",
            "--prometheus-port",
            "0",
            "--workers",
            "2",
            "--log-level",
            "warn",
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        try:

            async def ready() -> None:
                while True:
                    try:
                        if (await call(port, post("/generate", {"text": "x"}), timeout=2)).status == 200:
                            return
                    except OSError:
                        pass
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(ready(), 20)
            for url in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
                res = await add(port, url)
                assert res.status == 409 and res.json["error"]["code"] == "worker_is_router", res.body
            listed = await call(port, get("/workers"))
            assert [x["url"] for x in listed.json["workers"]] == [w.url]
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 20)
            await w.stop()

    run(body(), 60)


def test_a_long_worker_url_is_refused_with_its_length_not_echoed() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            res = await add(r.port, "http://127.0.0.1:1/" + "p" * 10_000)
            assert res.status == 400, res.body
            msg = res.json["error"]["message"]
            assert "longer than 2048" in msg and len(res.body) < 1000, msg
            assert [x.url for x in r.server.registry.workers] == [w.url]
        await w.stop()

    run(body())
