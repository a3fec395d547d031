"""``fastroute epp --failure-mode``: what a real Envoy does with the printed bootstrap when the
picker process is gone (SIGKILL). FailClose: the request fails and no worker sees it. FailOpen:
it goes round robin over the --worker-urls. Either way a client cannot pick the address itself
with its own ``x-gateway-destination-endpoint`` header. The same holds with ``--epp-mode http``
(Envoy's ext_proc ``http_service``), whose printed filter takes the same failure mode."""

from __future__ import annotations

import asyncio
import signal

from tests.integration.conftest import call, post, run, workers
from tests.integration.envoy_harness import Gateway

HEADER = "x-gateway-destination-endpoint"


async def _kill_picker(g: Gateway) -> None:
    assert g.epp is not None
    g.epp.send_signal(signal.SIGKILL)
    await g.epp.wait()


def test_fail_open_falls_back_to_the_worker_list_when_the_picker_is_gone() -> None:
    async def body() -> None:
        a, b, outsider = await workers(3)
        async with Gateway([a.url, b.url], "--policy", "round_robin", "--failure-mode", "FailOpen") as g:
            steer = {HEADER: f"127.0.0.1:{outsider.port}"}  # a client trying to choose the address
            r = await call(g.port, post("/generate", {"text": "picked"}, headers=steer), timeout=10)
            assert r.status == 200, r.body
            (rec,) = a.inference() + b.inference()
            assert rec.headers[HEADER] in (f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}")  # the picker's

            await _kill_picker(g)
            for i in range(4):
                r = await call(g.port, post("/generate", {"text": f"open {i}"}, headers=steer), timeout=10)
                assert r.status == 200, r.body
            assert len(a.inference()) + len(b.inference()) == 5
            assert {len(a.inference()), len(b.inference())} == {2, 3}  # round robin over the list
            for rec in a.inference()[-2:] + b.inference()[-2:]:
                assert HEADER not in rec.headers  # unpicked: the client's header was removed
            assert outsider.inference() == []

    run(body(), 90)


def test_fail_close_fails_the_request_when_the_picker_is_gone() -> None:
    async def body() -> None:
        a, outsider = await workers(2)
        async with Gateway([a.url]) as g:
            r = await call(g.port, post("/generate", {"text": "picked"}), timeout=10)
            assert r.status == 200, r.body
            await _kill_picker(g)
            steer = {HEADER: f"127.0.0.1:{outsider.port}"}
            r = await call(g.port, post("/generate", {"text": "closed"}, headers=steer), timeout=10)
            assert r.status >= 500, (r.status, r.body)
            await asyncio.sleep(0.2)
            assert len(a.inference()) == 1 and outsider.inference() == []

    run(body(), 90)


HTTP = ("--epp-mode", "http")


def test_http_mode_fail_open_falls_back_when_the_picker_is_gone() -> None:
    """--epp-mode http: the printed http_service filter is fail-open too; with the picker
    killed, requests go round robin over the --worker-urls and no client steers them."""

    async def body() -> None:
        a, b, outsider = await workers(3)
        flags = (*HTTP, "--policy", "round_robin", "--failure-mode", "FailOpen")
        async with Gateway([a.url, b.url], *flags) as g:
            steer = {HEADER: f"127.0.0.1:{outsider.port}"}
            r = await call(g.port, post("/generate", {"text": "picked"}, headers=steer), timeout=10)
            assert r.status == 200, r.body
            (rec,) = a.inference() + b.inference()
            assert rec.headers[HEADER] in (f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}")  # the picker's

            await _kill_picker(g)
            for i in range(4):
                r = await call(g.port, post("/generate", {"text": f"open {i}"}, headers=steer), timeout=10)
                assert r.status == 200, r.body
            assert {len(a.inference()), len(b.inference())} == {2, 3}  # round robin over the list
            for rec in a.inference()[-2:] + b.inference()[-2:]:
                assert HEADER not in rec.headers  # unpicked: the client's header was removed
            assert outsider.inference() == []

    run(body(), 90)


def test_http_mode_fail_close_fails_the_request_when_the_picker_is_gone() -> None:
    async def body() -> None:
        a, outsider = await workers(2)
        async with Gateway([a.url], *HTTP, "--policy", "round_robin") as g:
            r = await call(g.port, post("/generate", {"text": "picked"}), timeout=10)
            assert r.status == 200, r.body
            await _kill_picker(g)
            steer = {HEADER: f"127.0.0.1:{outsider.port}"}
            r = await call(g.port, post("/generate", {"text": "closed"}, headers=steer), timeout=10)
            assert r.status >= 500, (r.status, r.body)
            await asyncio.sleep(0.2)
            assert len(a.inference()) == 1 and outsider.inference() == []

    run(body(), 90)


def test_http_mode_a_picker_that_stops_answering_times_out_into_the_failure_mode() -> None:
    """A picker that is stopped (SIGSTOP: connected, silent) costs the message timeout of the
    printed http_service (10 s here); then FailOpen sends the request round robin and
    FailClose fails it. Nothing is booked by the stopped picker's answers."""

    async def body() -> None:
        a, b = await workers(2)
        for mode, ok in (("FailOpen", True), ("FailClose", False)):
            flags = (*HTTP, "--policy", "round_robin", "--failure-mode", mode)
            async with Gateway([a.url, b.url], *flags) as g:
                assert g.epp is not None
                before = len(a.inference()) + len(b.inference())
                g.epp.send_signal(signal.SIGSTOP)
                try:
                    r = await call(g.port, post("/generate", {"text": mode}), timeout=30)
                finally:
                    g.epp.send_signal(signal.SIGCONT)
                served = len(a.inference()) + len(b.inference()) - before
                if ok:
                    assert r.status == 200 and served == 1, (r.status, r.body)
                    rec = (a.inference() + b.inference())[-1]
                    assert HEADER not in rec.headers  # the fallback route, not a pick
                else:
                    assert r.status >= 500 and served == 0, (r.status, r.body)

    run(body(), 120)
