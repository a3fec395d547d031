"""Registry over real loopback HTTP: handshake, dp-aware targets, groups, admin endpoints."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from fakeworker import FakeWorker, Plane, make_config, run, wait_until

from fastroute.control.worker import split_host_port
from fastroute.core.table import COL_ALLOCATED, COL_HEALTHY


def acquire_targets(group, n: int) -> list[int]:
    """Acquire and immediately release n leases; -> picked target rows (None when 503)."""
    out = []
    for _ in range(n):
        lease = group.acquire(0)
        out.append(None if lease is None else lease.target)
        if lease is not None:
            assert lease.release()
    return out


def test_handshake_order_fallbacks_and_auth():
    async def body():
        fw = await FakeWorker(server_info_404=True, model_info_404=True).start()
        async with Plane(make_config(api_key="sekret")) as p:
            w = await p.add(fw)
            assert fw.paths() == ["/health", "/server_info", "/get_server_info", "/model_info", "/get_model_info"]
            assert "authorization" not in fw.requests[0].headers
            for r in fw.requests[1:]:
                assert r.headers["authorization"] == "Bearer sekret"
            assert w.status == "ready" and w.healthy
            assert w.model_id == "Fake-Model-7B"  # last segment of model_path
            assert w.server_info["max_total_num_tokens"] == 100000
            assert (w.server_info_path, w.model_info_path) == ("/get_server_info", "/get_model_info")
        await fw.stop()

    run(body)


def test_model_id_rule_prefers_requested_then_served_name():
    async def body():
        a = await FakeWorker(served_model_name="served-a").start()
        b = await FakeWorker(served_model_name="served-b").start()
        async with Plane(make_config()) as p:
            wa = await p.add(a)
            wb = await p.add(b, model_id="explicit-b")
            assert (wa.model_id, wb.model_id) == ("served-a", "explicit-b")
            status, doc, _ = await p.admin("GET", "/v1/models")
            assert status == 200 and [m["id"] for m in doc["data"]] == ["served-a", "explicit-b"]
        await a.stop()
        await b.stop()

    run(body)


def test_registration_waits_for_health_while_serving_503():
    async def body():
        fw = await FakeWorker(health_status=503).start()
        async with Plane(make_config()) as p:
            w = p.registry.add_worker(fw.url, "regular")
            await wait_until(lambda: fw.count("/health") >= 3)
            # Still pending: no target published, requests would get 503, readiness says not ready.
            assert w.status == "pending"
            assert p.registry.group("regular").acquire(0) is None
            status, doc, _ = await p.admin("GET", "/readiness")
            assert status == 503 and doc["status"] == "not ready"
            assert fw.count("/server_info") == 0
            fw.health_status = 200
            assert await p.registry.wait_registered(w)
            assert acquire_targets(p.registry.group("regular"), 2) == [w.targets[0]] * 2
            status, doc, _ = await p.admin("GET", "/readiness")
            assert status == 200 and doc == {"status": "ready", "healthy_workers": 1, "total_workers": 1}
        await fw.stop()

    run(body)


def test_startup_timeout_fails_and_drops_worker():
    async def body():
        fw = await FakeWorker(health_status=503).start()
        cfg = make_config(worker_startup_timeout_secs=0.3, worker_startup_check_interval=0.05)
        async with Plane(cfg) as p:
            w = p.registry.add_worker(fw.url, "regular")
            assert not await p.registry.wait_registered(w)
            assert w.status == "failed" and "not ready after" in w.error
            assert p.registry.find(fw.url) is None
            # Retried at the check interval, bounded by the timeout: ~6 probes, never a tight loop.
            assert 2 <= fw.count("/health") <= 10
            assert p.table.get(0, COL_ALLOCATED) == 0
        await fw.stop()

    run(body)


def test_unreachable_worker_fails_registration():
    async def body():
        fw = await FakeWorker().start()
        url = fw.url
        await fw.stop()  # port now closed: connection refused
        async with Plane(make_config(worker_startup_timeout_secs=0.2)) as p:
            w = p.registry.add_worker(url, "regular")
            assert not await p.registry.wait_registered(w)
            assert "connect" in w.error

    run(body)


def test_dp_aware_one_target_per_rank():
    async def body():
        d8 = await FakeWorker(dp_size=4).start()
        d1 = await FakeWorker(dp_size=1).start()
        async with Plane(make_config(pd_disaggregation=True, dp_aware=True)) as p:
            w8 = await p.add(d8, "decode")
            w1 = await p.add(d1, "decode")
            assert len(w8.targets) == 4 and len(set(w8.targets)) == 4
            assert w8.names == [f"{d8.url}@{r}" for r in range(4)]
            assert [p.registry.target_info[t] for t in w8.targets] == [(w8, r) for r in range(4)]
            assert w1.names == [d1.url] and p.registry.target_info[w1.targets[0]] == (w1, None)
            assert p.registry.target_name(w8.targets[2]) == f"{d8.url}@2"
            # The decode group sees all five targets as independent candidates.
            picked = acquire_targets(p.registry.group("decode"), 10)
            assert set(picked) == set(w8.targets) | set(w1.targets)
            status, doc, _ = await p.admin("GET", f"/workers/{w8.id}")
            assert status == 200 and doc["dp_size"] == 4
            assert [r["url"] for r in doc["dp_ranks"]] == w8.names
        await d8.stop()
        await d1.stop()

    run(body)


def test_dp_aware_without_dp_size_fails_fast():
    async def body():
        fw = await FakeWorker(dp_size=2, omit_dp_size=True).start()
        # Long startup timeout: the failure must be immediate, not a timeout.
        async with Plane(make_config(dp_aware=True, worker_startup_timeout_secs=60)) as p:
            w = p.registry.add_worker(fw.url, "regular")
            assert not await asyncio.wait_for(p.registry.wait_registered(w), 5)
            assert "dp_size" in w.error
            assert fw.count("/health") == 1
            # Without --dp-aware the same worker registers fine (dp_size is optional).
        async with Plane(make_config()) as p:
            w = await p.add(fw)
            assert len(w.targets) == 1
        await fw.stop()

    run(body)


def test_prefill_keeps_bootstrap_port_and_host():
    async def body():
        fw = await FakeWorker().start()
        async with Plane(make_config(pd_disaggregation=True)) as p:
            status, doc, _ = await p.admin(
                "POST", "/workers", {"url": fw.url, "worker_type": "prefill", "bootstrap_port": 8999}
            )
            assert status == 202
            w = p.registry.get(doc["worker_id"])
            assert await p.registry.wait_registered(w)
            assert (w.host, w.port, w.bootstrap_port, w.role) == ("127.0.0.1", fw.port, 8999, "prefill")
            _, wdoc, _ = await p.admin("GET", f"/workers/{w.id}")
            assert wdoc["bootstrap_port"] == 8999 and wdoc["worker_type"] == "prefill"
        await fw.stop()
        assert split_host_port("http://[::1]:8000") == ("[::1]", 8000)
        assert split_host_port("http://MyHost") == ("MyHost", 80)

    run(body)


def test_config_workers_register_in_background():
    async def body():
        pre = await FakeWorker().start()
        dec = await FakeWorker(health_status=503).start()
        cfg = make_config(pd_disaggregation=True, prefill=[(pre.url, 8998)], decode=[dec.url])
        async with Plane(cfg) as p:
            await asyncio.wait_for(p.registry.start(), 1)  # returns at once; decode still starting
            await wait_until(lambda: len(p.registry.ready_workers("prefill")) == 1)
            assert not p.registry.ready()
            status, doc, _ = await p.admin("GET", "/health_generate")
            assert status == 503 and doc["error"]["code"] == "no_healthy_worker_pair"
            dec.health_status = 200
            await wait_until(p.registry.ready)
            assert p.registry.ready_workers("prefill")[0].bootstrap_port == 8998
            status, text, _ = await p.admin("GET", "/health_generate")
            assert status == 200 and pre.url in text.decode() and dec.url in text.decode()
            assert pre.count("/health_generate") == 1 and dec.count("/health_generate") == 1
            dec.health_generate_status = 500
            status, doc, _ = await p.admin("GET", "/health_generate")
            assert status == 503 and dec.url in doc["error"]["message"]
        await pre.stop()
        await dec.stop()

    run(body)


def test_workers_api_add_get_put_delete_reaches_group():
    async def body():
        a = await FakeWorker().start()
        b = await FakeWorker().start()
        async with Plane(make_config()) as p:
            group = p.registry.group("regular")
            status, doc, _ = await p.admin("POST", "/workers", {"url": a.url})
            assert status == 202
            assert doc["status"] == "accepted" and doc["url"] == a.url
            assert doc["location"] == f"/workers/{doc['worker_id']}"
            uuid.UUID(doc["worker_id"])
            wa = p.registry.get(doc["worker_id"])
            assert await p.registry.wait_registered(wa)
            wb = await p.add(b)
            assert set(acquire_targets(group, 4)) == {wa.targets[0], wb.targets[0]}

            status, doc, _ = await p.admin("GET", "/workers")
            assert status == 200 and doc["total"] == 2 and doc["stats"]["regular_count"] == 2
            entry = doc["workers"][0]
            for k in (
                "id",
                "url",
                "model_id",
                "worker_type",
                "is_healthy",
                "load",
                "connection_mode",
                "priority",
                "cost",
            ):
                assert k in entry
            assert entry["url"] == a.url and entry["is_healthy"] is True

            status, doc, _ = await p.admin("PUT", f"/workers/{wa.id}", {"priority": 10})
            assert status == 202 and "update" in doc["message"] and wa.priority == 10

            status, doc, _ = await p.admin("DELETE", f"/workers/{wa.id}")
            assert status == 202 and "removal" in doc["message"]
            assert acquire_targets(group, 4) == [wb.targets[0]] * 4
            assert p.table.get(wa.targets[0], COL_ALLOCATED) == 0  # nothing in flight: freed now
            status, _, _ = await p.admin("GET", f"/workers/{wa.id}")
            assert status == 404

            # Errors: missing url, not a UUID, duplicate, bad worker_type.
            assert (await p.admin("POST", "/workers", {"worker_type": "decode"}))[0] == 422
            assert (await p.admin("GET", "/workers/not-a-uuid"))[0] == 400
            assert (await p.admin("POST", "/workers", {"url": b.url}))[0] == 409
            assert (await p.admin("POST", "/workers", {"url": "http://127.0.0.1:9", "worker_type": "x"}))[0] == 400
            assert (await p.admin("PATCH", "/workers"))[0] == 405
        await a.stop()
        await b.stop()

    run(body)


def test_remove_with_lease_in_flight_defers_row_free():
    async def body():
        fw = await FakeWorker(dp_size=2).start()
        async with Plane(make_config(dp_aware=True)) as p:
            w = await p.add(fw)
            lease = p.registry.group("regular").acquire(7)
            assert lease is not None
            t = lease.target
            p.registry.remove_worker(w)
            # Out of the group at once, but its busy row stays allocated (marked unhealthy)
            # and still resolvable for the request in flight; the idle rank is freed now.
            assert p.registry.group("regular").acquire(0) is None
            assert p.table.get(t, COL_ALLOCATED) == 1 and p.table.get(t, COL_HEALTHY) == 0
            assert p.registry.target_info[t] == (w, w.targets.index(t))
            other = [x for x in w.targets if x != t][0]
            assert p.table.get(other, COL_ALLOCATED) == 0
            assert lease.release()
            await wait_until(lambda: p.table.get(t, COL_ALLOCATED) == 0)
            assert p.registry.target_info[t] is None
        await fw.stop()

    run(body)


def test_legacy_add_list_remove():
    async def body():
        fw = await FakeWorker().start()
        dead = await FakeWorker(health_status=500).start()
        async with Plane(make_config(worker_startup_timeout_secs=0.2)) as p:
            status, text, _ = await p.admin("POST", f"/add_worker?url={fw.url}")
            assert status == 200 and text == f"Successfully added worker: {fw.url}".encode()
            status, doc, _ = await p.admin("GET", "/list_workers")
            assert status == 200 and doc == {"urls": [fw.url]}
            assert p.registry.group("regular").acquire(0) is not None
            status, text, _ = await p.admin("POST", f"/add_worker?url={fw.url}")
            assert status == 400 and b"already exists" in text
            status, text, _ = await p.admin("POST", f"/add_worker?url={dead.url}")
            assert status == 400 and text.startswith(b"Failed to add worker")
            status, text, _ = await p.admin("POST", "/add_worker")
            assert status == 400
            status, text, _ = await p.admin("POST", f"/remove_worker?url={fw.url}")
            assert status == 200 and text == f"Successfully removed worker: {fw.url}".encode()
            assert (await p.admin("GET", "/list_workers"))[1] == {"urls": []}
            assert (await p.admin("POST", f"/remove_worker?url={fw.url}"))[0] == 404
        await fw.stop()
        await dead.stop()

    run(body)


def test_flush_cache_200_206_and_405():
    async def body():
        a = await FakeWorker().start()
        b = await FakeWorker().start()
        async with Plane(make_config(api_key="k")) as p:
            await p.add(a)
            await p.add(b)
            auth = [(b"authorization", b"Bearer k")]
            status, doc, _ = await p.admin("POST", "/flush_cache", headers=auth)
            assert status == 200
            assert doc == {
                "status": "success",
                "message": "Successfully flushed cache on all 2 HTTP workers",
                "workers_flushed": 2,
                "total_http_workers": 2,
                "total_workers": 2,
            }
            assert a.count("/flush_cache") == 1 and b.count("/flush_cache") == 1
            assert [r.method for r in a.requests if r.path == "/flush_cache"] == ["POST"]
            assert a.requests[-1].headers["authorization"] == "Bearer k"
            b.flush_status = 500
            status, doc, _ = await p.admin("POST", "/flush_cache", headers=auth)
            assert status == 206 and doc["status"] == "partial_success" and doc["workers_flushed"] == 1
            assert [f["worker"] for f in doc["failed"]] == [b.url]
            assert (await p.admin("GET", "/flush_cache", headers=auth))[0] == 405
            # Protected by the router API key.
            status, doc, _ = await p.admin("POST", "/flush_cache")
            assert status == 401 and doc["error"]["code"] == "invalid_api_key"
            assert (await p.admin("GET", "/workers", headers={"Authorization": "Bearer k"}))[0] == 200
            assert (await p.admin("GET", "/workers", headers={"Authorization": "Bearer x"}))[0] == 401
            assert (await p.admin("GET", "/v1/models"))[0] == 200  # open
        await a.stop()
        await b.stop()

    run(body)


def test_get_loads_shape_null_until_polled():
    async def body():
        fw = await FakeWorker(
            dp_size=2,
            loads=[
                {"num_running_reqs": 3, "num_used_tokens": 300},
                {"num_running_reqs": 1, "num_waiting_reqs": 2, "num_used_tokens": 100},
            ],
        ).start()
        async with Plane(make_config(pd_disaggregation=True, dp_aware=True)) as p:
            w = await p.add(fw, "decode")
            lease = p.registry.group("decode").acquire(50)
            try:
                status, doc, _ = await p.admin("GET", "/get_loads")
                assert status == 200 and doc["dp_rank_count"] == 2
                rows = doc["loads"]
                assert [r["name"] for r in rows] == w.names and [r["dp_rank"] for r in rows] == [0, 1]
                for r in rows:
                    assert r["worker"] == fw.url and r["worker_type"] == "decode"
                    assert r["num_used_tokens"] is None and r["num_running_reqs"] is None
                assert sum(r["in_flight_requests"] for r in rows) == 1
                assert sum(r["in_flight_tokens"] for r in rows) == 50
                assert doc["workers"] == [{"worker": fw.url, "load": -1}]
                await p.monitor.poll_once()
                _, doc, _ = await p.admin("GET", "/get_loads")
                r0, r1 = doc["loads"]
                assert (r0["num_running_reqs"], r0["num_waiting_reqs"], r0["num_used_tokens"]) == (3, 0, 300)
                assert (r1["num_running_reqs"], r1["num_waiting_reqs"], r1["num_used_tokens"]) == (1, 2, 100)
                assert r1["num_total_reqs"] == 3 and r0["max_total_num_tokens"] == 100000
                assert doc["aggregate"]["total_used_tokens"] == 400
                assert doc["workers"] == [{"worker": fw.url, "load": 400}]
            finally:
                lease.release()
        await fw.stop()

    run(body)


def test_server_info_model_info_and_engine_metrics():
    async def body():
        pre = await FakeWorker(model_info_404=True).start()
        dec = await FakeWorker(dp_size=2).start()
        async with Plane(make_config(pd_disaggregation=True)) as p:
            await p.add(pre, "prefill")
            await p.add(dec, "decode")
            status, doc, _ = await p.admin("GET", "/get_server_info")
            assert status == 200 and len(doc["prefill"]) == 1 and len(doc["decode"]) == 1
            assert doc["internal_states"] == dec_states(2)
            assert (await p.admin("GET", "/server_info"))[1] == doc
            status, doc, _ = await p.admin("GET", "/get_model_info")
            assert status == 200 and doc["model_path"] == pre.model_path
            assert pre.requests[-1].path == "/get_model_info"  # remembered fallback
            status, text, ctype = await p.admin("GET", "/engine_metrics")
            assert status == 200 and ctype.startswith(b"text/plain")
            lines = text.decode().splitlines()
            assert lines.count("# TYPE fake_gauge gauge") == 1
            assert f'fake_gauge{{worker="{pre.url}"}} 1' in lines
            assert f'fake_gauge{{worker="{dec.url}"}} 1' in lines
            assert (await p.admin("GET", "/nope"))[0] == 404
        await pre.stop()
        await dec.stop()

    run(body)


def dec_states(n: int) -> list[dict]:
    return [{"rank": r, "avg_spec_accept_length": 1.0} for r in range(n)]


# ---- httpclient edge cases (raw sockets answering fixed bytes) ------------------------------------
async def raw_server(reply: bytes, close: bool = True, delay: float = 0.0):
    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        if delay:
            await asyncio.sleep(delay)
        writer.write(reply)
        await writer.drain()
        if close:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


def test_httpclient_framing_and_errors():
    from fastroute.control import httpclient as hc

    async def body():
        srv, url = await raw_server(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        )
        status, headers, data = await hc.request("GET", url + "/x")
        assert (status, data, hc.header(headers, "x-a")) == (200, b"abcde", "b")
        srv.close()
        # No framing headers: the body ends at EOF.
        srv, url = await raw_server(b"HTTP/1.1 201 Created\r\n\r\nuntil-eof")
        assert (await hc.request("GET", url))[::2] == (201, b"until-eof")
        srv.close()
        # Truncated body (Content-Length larger than what arrives).
        srv, url = await raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        with pytest.raises(hc.HttpProtocolError):
            await hc.request("GET", url)
        srv.close()
        srv, url = await raw_server(b"NOT HTTP AT ALL\r\n\r\n")
        with pytest.raises(hc.HttpProtocolError):
            await hc.request("GET", url)
        srv.close()
        srv, url = await raw_server(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", delay=1.0)
        with pytest.raises(hc.HttpTimeout):
            await hc.request("GET", url, timeout=0.1)
        srv.close()
        with pytest.raises(hc.HttpConnectError):
            await hc.request("GET", "ftp://127.0.0.1/x")
        # Request bytes: method, path+query, Host, Content-Length and custom headers.
        fw = await FakeWorker().start()
        await hc.request("POST", fw.url + "/flush_cache?a=1", body=b"{}", headers=[("X-Y", "z")])
        r = fw.requests[-1]
        assert (r.method, r.path, r.query, r.body) == ("POST", "/flush_cache", "a=1", b"{}")
        assert r.headers["x-y"] == "z" and r.headers["content-length"] == "2"
        assert r.headers["host"] == f"127.0.0.1:{fw.port}"
        await fw.stop()

    run(body)
