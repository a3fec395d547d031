"""PD through the gateway: ``fastroute epp --pd-disaggregation --sidecar-port P`` behind a real
Envoy picks the pair, Envoy sends the request to the ``fastroute sidecar`` process of the decode
pod (the decode worker's IP, 127.0.0.2 here, port P), whose PD relay sends both legs to the
pair the picker named. Fake SGLang prefill/decode workers record what each leg received."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import pytest

pytest.importorskip("grpc")

from tests.integration.conftest import call, get, post, run, workers  # noqa: E402
from tests.integration.envoy_harness import Gateway, free_port  # noqa: E402
from tests.integration.test_discovery import PodWorker  # noqa: E402


async def _sidecar(port: int, pd: list[str]) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fastroute",
        "sidecar",
        "--host",
        "0.0.0.0",
        "--port",
        str(port),
        *pd,
        "--disable-health-check",
        "--worker-startup-check-interval",
        "1",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--shutdown-grace-period-secs",
        "1",
        "--log-level",
        "warning",
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while loop.time() < deadline:
        try:
            if (await call(port, get("/readiness"), timeout=1)).status == 200:
                return proc
        except (OSError, asyncio.TimeoutError, EOFError):
            pass
        await asyncio.sleep(0.1)
    proc.kill()
    raise AssertionError("the sidecar never became ready")


def test_pd_through_envoy_the_picker_pins_the_pair_and_the_sidecar_relays_it() -> None:
    async def body() -> None:
        ps = await workers(2, role="prefill")
        d = await PodWorker("127.0.0.2", role="decode").start()
        sport = free_port()
        bports = {ps[0].url: 8998, ps[1].url: 8999}
        pd = ["--pd-disaggregation", "--prefill", ps[0].url, "8998", "--prefill", ps[1].url, "8999", "--decode", d.url]
        sidecar = await _sidecar(sport, [*pd, "--policy", "random"])
        try:
            # the sidecar never picks on its own: without the picker's pair it refuses
            r = await call(sport, post("/generate", {"text": "direct"}), timeout=10)
            assert r.status == 503 and d.inference() == []
            async with Gateway([], *pd, "--policy", "round_robin", "--sidecar-port", str(sport)) as g:
                for i in range(6):
                    r = await call(g.port, post("/generate", {"text": f"q{i}"}), timeout=10)
                    assert r.status == 200, r.body
                    assert r.json["text"] == f"hello from {d.name}"
                assert len(ps[0].inference()) == len(ps[1].inference()) == 3  # the picker's turn
                dec = {rec.json["text"]: rec for rec in d.inference()}
                assert len(dec) == 6
                for p in ps:
                    for rec in p.inference():
                        pre, dname = rec.headers["x-smg-routing-key"].split("|")
                        assert (pre, dname) == (p.url, d.url)  # the leg the picker named
                        twin = dec[rec.json["text"]].json
                        assert twin["bootstrap_host"] == "127.0.0.1"
                        assert twin["bootstrap_port"] == rec.json["bootstrap_port"] == bports[p.url]
                        assert twin["bootstrap_room"] == rec.json["bootstrap_room"]
                await g.until_in_flight(
                    lambda f: sum(f.values()) == 0 and len(f) == 3, 10, "both legs released at the picker"
                )
        finally:
            sidecar.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(sidecar.wait(), 10)
            except asyncio.TimeoutError:
                sidecar.kill()
            await d.stop()
            for p in ps:
                await p.stop()

    run(body(), 90)
