"""--enable-igw over real sockets: the request's model picks the workers; another model's worker
gets 0 requests; an unknown model gets smg's 404 model_not_found; /v1/models lists each model once; aliases,
--dp-aware, PD and workers added and removed at run time."""

from __future__ import annotations

import json
from typing import Any

from tests.integration.conftest import DataWorker, Router, call, get, post, run, until


class ModelWorker(DataWorker):
    """DataWorker that serves a named model (its /server_info and /model_info say so)."""

    def __init__(self, model: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.model = model

    def control(self, path: str) -> tuple[int, bytes] | None:
        ans = super().control(path)
        if ans is None or path not in (
            "/server_info",
            "/get_server_info",
            "/model_info",
            "/get_model_info",
            "/v1/models",
        ):
            return ans
        doc = json.loads(ans[1])
        if path == "/v1/models":
            doc["data"][0]["id"] = self.model
        else:
            doc["model_path"] = "/models/org/" + self.model
        return 200, json.dumps(doc).encode()


async def model_workers(*models: str, **kw: Any) -> list[ModelWorker]:
    return [await ModelWorker(m, **kw).start() for m in models]


def chat(model: str | None) -> bytes:
    obj: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
    if model is not None:
        obj["model"] = model
    return post("/v1/chat/completions", obj)


def test_each_model_goes_only_to_its_workers() -> None:
    async def body() -> None:
        a1, a2, b1 = await model_workers("model-a", "model-a", "model-b")
        async with Router(worker_urls=[w.url for w in (a1, a2, b1)], enable_igw=True, policy="round_robin") as r:
            for _ in range(10):
                assert (await call(r.port, chat("model-a"))).status == 200
            assert len(b1.inference()) == 0  # 0 to the other model
            assert len(a1.inference()) == len(a2.inference()) == 5  # balanced inside model-a
            for _ in range(3):
                assert (await call(r.port, chat("model-b"))).status == 200
            assert len(b1.inference()) == 3 and len(a1.inference()) + len(a2.inference()) == 10
            # the full model path names the same model
            assert (await call(r.port, chat("/models/org/model-b"))).status == 200
            assert len(b1.inference()) == 4
            # unknown model: smg's 404 model_not_found listing the models (an OpenAI client
            # retries a 503, not a 404); nobody is asked
            res = await call(r.port, chat("model-z"))
            assert res.status == 404
            err = res.json["error"]
            assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
            assert res.headers.get("x-smg-error-code") == "model_not_found"
            assert "model-z" in err["message"] and "model-a, model-b" in err["message"]
            # no model with two models served: a 400 naming them
            res = await call(r.port, chat(None))
            assert res.status == 400 and "model-a" in res.json["error"]["message"]
            assert len(a1.inference()) + len(a2.inference()) + len(b1.inference()) == 14
            # /v1/models lists each model once
            res = await call(r.port, get("/v1/models"))
            assert [m["id"] for m in res.json["data"]] == ["model-a", "model-b"]
            await until(lambda: all(r.in_flight(w) == 0 for w in (a1, a2, b1)), what="released")

    run(body())


def test_alias_and_runtime_add_remove() -> None:
    async def body() -> None:
        (a,) = await model_workers("model-a")
        (b,) = await model_workers("model-b")
        async with Router(worker_urls=[a.url], enable_igw=True, model_alias=["small=model-a", "fast=model-b"]) as r:
            assert (await call(r.port, chat("small"))).status == 200 and len(a.inference()) == 1
            # alias of a model nobody serves yet: unknown
            assert (await call(r.port, chat("fast"))).status == 404
            add = f"POST /add_worker?url={b.url} HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n"
            assert (await call(r.port, add.encode())).status == 200
            assert (await call(r.port, chat("fast"))).status == 200 and len(b.inference()) == 1
            assert (await call(r.port, chat("model-b"))).status == 200 and len(b.inference()) == 2
            # a single model left after removing model-a: requests without a model go to it
            rm = f"POST /remove_worker?url={a.url} HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n"
            assert (await call(r.port, rm.encode())).status == 200
            assert (await call(r.port, chat("model-a"))).status == 404
            assert (await call(r.port, chat(None))).status == 200 and len(b.inference()) == 3
            assert len(a.inference()) == 1

    run(body())


def test_dp_aware_ranks_stay_in_their_model() -> None:
    async def body() -> None:
        (a,) = await model_workers("model-a", dp_size=2)
        (b,) = await model_workers("model-b", dp_size=2)
        async with Router(worker_urls=[a.url, b.url], enable_igw=True, dp_aware=True, policy="round_robin") as r:
            for _ in range(4):
                assert (await call(r.port, chat("model-b"))).status == 200
            ranks = sorted(rec.json["data_parallel_rank"] for rec in b.inference())
            assert ranks == [0, 0, 1, 1] and not a.inference()

    run(body())


def test_pd_pairs_stay_in_their_model() -> None:
    async def body() -> None:
        pa, pb = await model_workers("model-a", "model-b", role="prefill")
        da, db = await model_workers("model-a", "model-b", role="decode")
        async with Router(
            pd_disaggregation=True, enable_igw=True, prefill=[(pa.url, 8998), (pb.url, 8999)], decode=[da.url, db.url]
        ) as r:
            for _ in range(3):
                res = await call(r.port, post("/generate", {"text": "hi", "model": "model-b"}))
                assert res.status == 200
            assert len(pb.inference()) == len(db.inference()) == 3
            assert not pa.inference() and not da.inference()
            assert (await call(r.port, post("/generate", {"text": "hi", "model": "x"}))).status == 404

    run(body())


def test_without_igw_models_are_not_looked_at() -> None:
    async def body() -> None:
        a, b = await model_workers("model-a", "model-b")
        async with Router(worker_urls=[a.url, b.url], policy="round_robin") as r:
            for _ in range(4):
                assert (await call(r.port, chat("model-z"))).status == 200
            assert len(a.inference()) == len(b.inference()) == 2

    run(body())


def test_igw_under_several_proxy_processes() -> None:
    """--workers 2: every proxy process mirrors the workers and groups them by model too."""
    from tests.integration.test_multiproc import MultiRouter

    async def body() -> None:
        a, b = await model_workers("model-a", "model-b")
        async with MultiRouter("--worker-urls", a.url, b.url, "--enable-igw", "--policy", "round_robin") as r:
            for _ in range(8):  # fresh connections land on both processes
                assert (await call(r.port, chat("model-b"))).status == 200
            assert len(b.inference()) == 8 and not a.inference()
            assert (await call(r.port, chat("model-q"))).status == 404

    run(body(), timeout=60)


def test_worker_metrics_carry_the_model() -> None:
    async def body() -> None:
        a, b = await model_workers("model-a", "model-b")
        async with Router(worker_urls=[a.url, b.url], enable_igw=True, policy="round_robin") as r:
            for _ in range(3):
                assert (await call(r.port, chat("model-b"))).status == 200
            text = (await call(r.server.metrics.port, get("/metrics"))).body.decode()
            assert (
                'smg_worker_selection_total{connection_mode="http",model="model-b",'
                'policy="round_robin",worker_type="regular"} 3.0'
            ) in text
            assert 'smg_worker_pool_size{connection_mode="http",model="model-a",' in text

    run(body())
