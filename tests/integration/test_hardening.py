"""Issue 24 hardening, over real sockets: each defect's hostile input gets a clear answer and
leaves the router fully working (scrapes, leases, later requests)."""
from __future__ import annotations

import json

from conftest import DataWorker, RawClient, Router, call, get, post, run, until, workers


class OddModelWorker(DataWorker):
    """A worker whose served_model_name holds a lone surrogate (a JSON "\\ud800" escape)."""

    def control(self, path: str):
        if path in ("/server_info", "/get_server_info"):
            info = {"model_path": "/models/fake-model", "served_model_name": "odd\ud800name",
                    "dp_size": 1, "tp_size": 1, "max_total_num_tokens": 100000,
                    "disaggregation_mode": "null"}
            return 200, json.dumps(info).encode()      # ensure_ascii: the escape on the wire
        return super().control(path)


async def scrape(r: Router) -> tuple[int, str]:
    res = await call(r.server.metrics.port, get("/metrics"))
    return res.status, res.body.decode("utf-8")


def test_lone_surrogates_in_model_names_never_blind_metrics() -> None:
    async def body() -> None:
        w = await OddModelWorker().start()
        async with Router(worker_urls=[w.url]) as r:
            assert (await scrape(r))[0] == 200
            raw = b'{"text": "x", "model": "\\ud800"}'
            res = await call(r.port, post("/generate", raw))
            assert res.status == 200, res.body
            for _ in range(2):   # every later scrape works, not just the next one
                status, text = await scrape(r)
                assert status == 200
                assert 'model="\\\\ud800"' in text            # the escape, as a label value
                assert 'model="odd\\\\ud800name"' in text
            assert r.in_flight(w) == 0
            assert (await call(r.port, post("/generate", {"text": "again"}))).status == 200
        await w.stop()
    run(body())

