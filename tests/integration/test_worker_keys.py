"""Over real sockets: a worker removed and added again under the same URL
with a new api_key receives the new key (pools follow the worker, not its URL)."""

from __future__ import annotations

import json

from tests.integration.conftest import Router, call, post, run, until, workers


async def _admin(port: int, method: str, path: str, doc=None) -> tuple[int, dict]:
    data = json.dumps(doc).encode() if doc is not None else b""
    raw = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data
    res = await call(port, raw)
    return res.status, (res.json if res.body else {})


def test_re_added_worker_gets_its_new_key() -> None:
    async def body() -> None:
        (anchor, w) = await workers(2)
        async with Router(worker_urls=[anchor.url], policy="round_robin") as r:
            keys_seen: list[str] = []
            for key in ("key-one", "key-two"):
                status, doc = await _admin(r.port, "POST", "/workers", {"url": w.url, "api_key": key})
                assert status == 202, doc
                wid = doc["worker_id"]
                await until(lambda: len(r.server.registry.group("regular").targets) == 2, what="worker registered")
                before = len(w.inference())
                for i in range(4):  # round robin over two workers: two reach w
                    assert (await call(r.port, post("/generate", {"text": f"{key} {i}"}))).status == 200
                got = [rec.headers.get("authorization") for rec in w.inference()[before:]]
                assert got and all(g == f"Bearer {key}" for g in got), got
                keys_seen += got
                status, _ = await _admin(r.port, "DELETE", f"/workers/{wid}")
                assert status == 202
                await until(lambda: len(r.server.registry.group("regular").targets) == 1, what="worker removed")
            assert "Bearer key-one" in keys_seen and "Bearer key-two" in keys_seen

    run(body())
