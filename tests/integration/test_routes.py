"""Every route of the route table over real sockets: each reaches a worker and returns the
worker's answer (JSON, and SSE where the route streams); PD mode answers 501 for the routes
the peers' PD routers do not serve; the token estimate per route books the ledger."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from fastroute.dataplane.routes import INFERENCE, ROUTES
from tests.integration.conftest import DataWorker, Router, call, post, run, until, workers

# A request body per route, shaped like the peers' docs show them.
BODIES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"model": "fake-model", "input": ["hello world", "second text"]},
    "/v1/rerank": {
        "model": "fake-model",
        "query": "capital of France",
        "documents": ["Paris is the capital", "Berlin is a city"],
    },
    "/rerank": {"query": "q", "documents": ["a", "b"]},
    "/v1/score": {"model": "fake-model", "query": "Is this good?", "items": ["yes", "no"], "label_token_ids": [1, 2]},
    "/v1/classify": {"model": "fake-model", "input": "I love this product!"},
    "/v1/tokenize": {"model": "fake-model", "prompt": "Hello, world!"},
    "/v1/detokenize": {"model": "fake-model", "tokens": [15339, 11, 1917, 0]},
    "/v1/responses": {"model": "fake-model", "input": "Tell me a joke", "instructions": "Be brief"},
    "/v1/messages": {"model": "fake-model", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
    "/generate": {"text": "hi"},
    "/v1/completions": {"prompt": "hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
}
NEW_ROUTES = [p for p in BODIES if p not in ("/generate", "/v1/completions", "/v1/chat/completions")]


class RouteWorker(DataWorker):
    """DataWorker that serves every route of the table and answers with the path it got."""

    paths = tuple(p.decode() for p in INFERENCE)

    def json_body(self, obj: dict) -> bytes:
        return json.dumps({"served_by": self.name, "echo": obj}).encode()


async def route_workers(n: int, **kw: Any) -> list[RouteWorker]:
    return [await RouteWorker(**kw).start() for _ in range(n)]


def test_table_covers_the_peer_routes() -> None:
    assert set(BODIES) == {p.decode() for p in ROUTES}
    assert ROUTES[b"/rerank"].endpoint == "/v1/rerank"
    assert [p for p, s in ROUTES.items() if s.pd] == [b"/generate", b"/v1/completions", b"/v1/chat/completions"]


@pytest.mark.parametrize("path", NEW_ROUTES)
def test_each_route_reaches_a_worker_and_returns_its_answer(path: str) -> None:
    async def body() -> None:
        ws = await route_workers(2)
        async with Router(worker_urls=[w.url for w in ws]) as r:
            for i in range(2):
                res = await call(r.port, post(path, BODIES[path], {"X-Request-Id": f"r{i}"}))
                assert res.status == 200, res.body
                doc = res.json
                assert doc["echo"] == BODIES[path]
                assert res.headers["x-request-id"] == f"r{i}"
            got = [rec for w in ws for rec in w.requests if rec.path == path]
            assert len(got) == 2 and {rec.method for rec in got} == {"POST"}
            assert all(rec.json == BODIES[path] for rec in got)  # the client's body, unchanged
            # round robin through the same lease/policy path: one request per worker
            assert [sum(rec.path == path for rec in w.requests) for w in ws] == [1, 1]
            await until(lambda: all(r.in_flight(w) == 0 for w in ws), what="released")

    run(body())


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_streaming_routes_relay_sse(path: str) -> None:
    async def body() -> None:
        (w,) = await route_workers(1)
        async with Router(worker_urls=[w.url]) as r:
            res = await call(r.port, post(path, {**BODIES[path], "stream": True}))
            assert res.status == 200
            assert res.headers["content-type"] == "text/event-stream"
            events = [e for e in res.body.split(b"\n\n") if e]
            assert len(events) == w.events + 1 and events[-1] == b"data: [DONE]"

    run(body())


def test_get_on_a_post_route_is_405() -> None:
    async def body() -> None:
        (w,) = await route_workers(1)
        async with Router(worker_urls=[w.url]) as r:
            res = await call(r.port, b"GET /v1/embeddings HTTP/1.1\r\nHost: r\r\n\r\n")
            assert res.status == 405 and not w.inference()

    run(body())


def test_token_estimate_books_the_ledger_per_route() -> None:
    async def body() -> None:
        (w,) = await route_workers(1)
        async with Router(worker_urls=[w.url]) as r:
            t = r.server.registry.find(w.url).targets[0]
            w.hold()
            text = "x" * 400  # 100 tokens at 4 bytes/token
            c = call(r.port, post("/v1/embeddings", {"input": [text, text]}))
            task = asyncio.ensure_future(c)
            await until(lambda: w.held == 1, what="held")
            assert r.server.table.in_flight_tokens(t) == 200
            w.release()
            assert (await task).status == 200
            await until(lambda: r.server.table.in_flight_tokens(t) == 0, what="released")

    run(body())


@pytest.mark.parametrize("path", NEW_ROUTES)
def test_pd_mode_answers_501_for_routes_pd_cannot_serve(path: str) -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url]) as r:
            res = await call(r.port, post(path, BODIES[path]))
            assert res.status == 501
            err = res.json["error"]
            assert err["code"] == "not_implemented" and path in err["message"]
            assert res.headers["x-smg-error-code"] == "not_implemented"
            assert not p.requests[-1:] or p.requests[-1].path != path
            assert not any(rec.path == path for rec in d.requests)

    run(body())
