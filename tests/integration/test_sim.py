"""Simulated SGLang workers over real loopback sockets: protocol answers, room rendezvous (in
process and over the bootstrap listener), DP rank placement, abort on disconnect, the busiest
rank pacing the step, the load generator end to end, and a short `fastroute demo` run."""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection, HttpError, fetch
from fastroute.sim.loadgen import Target, TraceItem, run_load
from fastroute.sim.server import SimWorker
from fastroute.sim.worker import start_cluster

H = "127.0.0.1"


def run(coro, timeout: float = 30.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``pred`` (sync) until true; the bound makes a broken simulator fail, not hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def get_json(port: int, path: str) -> tuple[int, object]:
    status, body = await fetch(H, port, "GET", path)
    return status, json.loads(body) if body[:1] in (b"{", b"[") else body


def gen_body(n_in: int = 100, n_out: int = 5, stream: bool = False, **extra) -> bytes:
    d = {"input_ids": [1] * n_in, "sampling_params": {"max_new_tokens": n_out}, "stream": stream}
    d.update(extra)
    return json.dumps(d).encode()


def test_protocol_answers() -> None:
    async def scenario() -> None:
        c = await start_cluster(params=SimParams(dp_size=4, time_scale=0.01))
        try:
            p, d = c.prefills[0], c.decodes[0]
            for path in ("/server_info", "/get_server_info"):
                st, info = await get_json(d.port, path)
                assert st == 200 and info["dp_size"] == 4 and info["disaggregation_mode"] == "decode"
                assert len(info["internal_states"]) == 4
            st, info = await get_json(p.port, "/server_info")
            assert (
                info["disaggregation_mode"] == "prefill" and info["disaggregation_bootstrap_port"] == p.bootstrap_port
            )
            assert info["load_balance_method"] == "follow_bootstrap_room"
            for path in ("/model_info", "/get_model_info"):
                st, mi = await get_json(d.port, path)
                assert st == 200 and mi["is_generation"] is True
            st, models = await get_json(d.port, "/v1/models")
            assert models["data"][0]["id"] == "sim-model"
            assert (await fetch(H, d.port, "GET", "/health"))[0] == 200
            assert (await fetch(H, d.port, "GET", "/health_generate"))[0] == 200
            assert (await fetch(H, d.port, "POST", "/flush_cache"))[0] == 200
            assert (await fetch(H, d.port, "GET", "/nope"))[0] == 404

            st, loads = await get_json(d.port, "/v1/loads?include=core")
            assert st == 200 and loads["dp_rank_count"] == 4 and len(loads["loads"]) == 4
            entry = loads["loads"][2]
            for k in (
                "dp_rank",
                "num_running_reqs",
                "num_waiting_reqs",
                "num_total_reqs",
                "num_used_tokens",
                "max_total_num_tokens",
                "token_usage",
            ):
                assert k in entry
            assert entry["dp_rank"] == 2 and "disaggregation" not in entry
            assert set(loads["aggregate"]) >= {"total_running_reqs", "total_waiting_reqs", "total_used_tokens"}
            st, loads = await get_json(d.port, "/v1/loads?include=core,disagg,queues&dp_rank=3")
            assert [e["dp_rank"] for e in loads["loads"]] == [3]
            assert loads["loads"][0]["disaggregation"]["mode"] == "decode" and "queues" in loads["loads"][0]
            st, loads = await get_json(d.port, "/v1/loads")  # default: all sections
            assert "memory" in loads["loads"][0] and "disaggregation" in loads["loads"][0]
            assert (await fetch(H, d.port, "GET", "/v1/loads?include=bogus"))[0] == 400
            assert (await fetch(H, d.port, "GET", "/v1/loads?dp_rank=9"))[0] == 400
            st, gl = await get_json(d.port, "/get_load")
            assert st == 200 and [e["dp_rank"] for e in gl] == [0, 1, 2, 3]
            assert set(gl[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
            st, _ = await fetch(H, d.port, "POST", "/generate", b'{"text": 1}')
            assert st == 400
        finally:
            await c.stop()

    run(scenario())


def _room_fields(p: SimWorker, room: int) -> dict:
    return {"bootstrap_host": H, "bootstrap_port": p.bootstrap_port, "bootstrap_room": room}


@pytest.mark.parametrize("shared_board", [True, False], ids=["in-process", "bootstrap-http"])
def test_decode_waits_for_its_room(shared_board: bool) -> None:
    async def scenario() -> None:
        params = SimParams(dp_size=2, time_scale=0.01)
        p = SimWorker("prefill", params)
        # Without a shared map the decode must long-poll the prefill's bootstrap listener.
        d = SimWorker("decode", params, boards=p.boards if shared_board else {})
        await p.start()
        await d.start()
        try:
            body = gen_body(50, 3, **_room_fields(p, 4242))
            dconn, pconn = HttpConnection(H, d.port), HttpConnection(H, p.port)
            dtask = asyncio.ensure_future(dconn.request("POST", "/generate", body))
            await until(lambda: sum(w for _, w, _ in d.rank_loads()) == 1, what="decode holding the request")
            await asyncio.sleep(0.05)  # many steps' worth: the decode must still not run it
            assert not dtask.done() and sum(r for r, _, _ in d.rank_loads()) == 0
            assert d.decode.tokens_out == 0
            # A prefill of another room does not release it.
            st, _, _ = await pconn.request("POST", "/generate", gen_body(50, 1, **_room_fields(p, 1)))
            assert st == 200
            await asyncio.sleep(0.05)
            assert not dtask.done()
            st, _, pb = await pconn.request("POST", "/generate", gen_body(50, 1, **_room_fields(p, 4242)))
            assert st == 200 and json.loads(pb)["meta_info"]["prompt_tokens"] == 50
            st, _, db = await asyncio.wait_for(dtask, 5)
            assert st == 200 and json.loads(db)["meta_info"]["completion_tokens"] == 3
            dconn.close()
            pconn.close()
        finally:
            await d.stop()
            await p.stop()

    run(scenario())


def test_rank_placement_by_body_field_else_round_robin() -> None:
    async def scenario() -> None:
        d = SimWorker("decode", SimParams(dp_size=8, time_scale=0.01))
        await d.start()
        try:
            conn = HttpConnection(H, d.port)
            for extra in (
                {"routed_dp_rank": 5},
                {"data_parallel_rank": 3},
                {"routed_dp_rank": 6, "data_parallel_rank": 1},
                {},
                {},
                {},
            ):
                st, _, _ = await conn.request("POST", "/generate", gen_body(10, 1, **extra))
                assert st == 200
            assert d.decode.placed == [1, 1, 1, 1, 0, 1, 1, 0]  # 5, 3, 6 then round-robin 0, 1, 2
            st, _, _ = await conn.request("POST", "/generate", gen_body(10, 1, routed_dp_rank=8))
            assert st == 400
            conn.close()
        finally:
            await d.stop()

    run(scenario())


def test_client_disconnect_aborts_and_frees_the_slot() -> None:
    async def scenario() -> None:
        d = SimWorker("regular", SimParams(dp_size=2, time_scale=0.01))
        await d.start()
        try:
            got: list[bytes] = []
            conn = HttpConnection(H, d.port)
            task = asyncio.ensure_future(
                conn.request("POST", "/generate", gen_body(1000, 100_000, True, routed_dp_rank=1), on_chunk=got.append)
            )
            await until(lambda: len(got) >= 3, what="tokens streaming")
            assert d.rank_loads()[1][0] == 1 and d.rank_loads()[1][2] > 1000
            task.cancel()  # closes the connection mid-stream
            await asyncio.gather(task, return_exceptions=True)
            await until(lambda: d.rank_loads() == [(0, 0, 0), (0, 0, 0)], what="slot and KV freed")
            assert d.decode.aborted == 1 and d.decode.completed == 0
            assert all(r.used == 0 and r.held == 0 for r in d.decode.ranks)
        finally:
            await d.stop()

    run(scenario())


def test_connection_lost_before_the_head_leaves_no_unretrieved_error() -> None:
    """The server drops a request waiting for its head (``on_head``): the caller gets HttpError
    from the head, and the body future that failed with it must not leak "Future exception was
    never retrieved" (the noise at the end of demo runs)."""

    async def scenario() -> list:
        loop = asyncio.get_running_loop()
        errors: list = []
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx.get("message")))
        d = SimWorker("decode", SimParams(dp_size=1, time_scale=0.01))
        await d.start()
        try:
            conn = HttpConnection(H, d.port)
            # A room that never arrives: the decode holds the request without answering.
            body = gen_body(10, 5, False, bootstrap_room=7, bootstrap_host=H, bootstrap_port=1)
            task = asyncio.ensure_future(conn.request("POST", "/generate", body, on_head=lambda _s: None))
            await until(lambda: d.requests == 1, what="request held")
            for sc in list(d.server._conns):
                sc.transport.close()
            res = await asyncio.gather(task, return_exceptions=True)
            assert isinstance(res[0], HttpError), res
            del task, res
        finally:
            await d.stop()
        await asyncio.sleep(0.05)  # let the closed transports drop their protocols
        gc.collect()
        return errors

    errors = run(scenario())
    assert not [e for e in errors if e and "never retrieved" in e], errors


def test_keep_alive_connection_closing_under_the_client_is_replaced() -> None:
    """The transport is closing (e.g. the server's FIN was just read) but connection_lost has
    not run yet: the next request must go out on a fresh connection, not into the closing one."""

    async def scenario() -> None:
        d = SimWorker("regular", SimParams(dp_size=1, time_scale=0.01))
        await d.start()
        try:
            conn = HttpConnection(H, d.port)
            assert (await conn.request("GET", "/health"))[0] == 200
            conn._proto.transport.close()  # closing; its connection_lost is only scheduled
            # awaited directly (no wait_for task): the request starts before connection_lost runs
            status, _, _ = await conn.request("GET", "/health")
            assert status == 200
            conn.close()
        finally:
            await d.stop()

    run(scenario())


def test_streaming_formats_and_openai_client() -> None:
    async def scenario() -> tuple[int, list[bytes], int]:
        d = SimWorker("regular", SimParams(dp_size=2, time_scale=0.01))
        await d.start()
        try:
            got: list[bytes] = []
            conn = HttpConnection(H, d.port)
            st, hdr, _ = await conn.request("POST", "/generate", gen_body(10, 4, True), on_chunk=got.append)
            conn.close()
            events = [e for e in b"".join(got).split(b"\n\n") if e]
            assert hdr[b"content-type"].startswith(b"text/event-stream")
            return st, events, d.port
        finally:
            await d.stop()

    st, events, _ = run(scenario())
    assert st == 200 and events[-1] == b"data: [DONE]" and len(events) == 5
    last = json.loads(events[-2][6:])
    assert last["meta_info"]["completion_tokens"] == 4 and last["meta_info"]["finish_reason"]["type"] == "length"

    openai = pytest.importorskip("openai")
    import threading

    ready = threading.Event()
    box: dict = {}

    def serve() -> None:
        async def main() -> None:
            w = SimWorker("regular", SimParams(dp_size=2, time_scale=0.01))
            await w.start()
            box["port"], box["stop"] = w.port, asyncio.Event()
            box["loop"] = asyncio.get_running_loop()
            ready.set()
            await asyncio.wait_for(box["stop"].wait(), 60)
            await w.stop()

        asyncio.run(main())

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    assert ready.wait(10)
    try:
        client = openai.OpenAI(base_url=f"http://{H}:{box['port']}/v1", api_key="x", timeout=10, max_retries=0)
        chunks = list(
            client.chat.completions.create(
                model="sim-model",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == " t t t" and chunks[-1].usage.completion_tokens == 3
        comp = client.completions.create(model="sim-model", prompt="abcdefgh", max_tokens=2)
        assert comp.usage.prompt_tokens == 2 and comp.choices[0].finish_reason == "length"
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        th.join(10)


def test_busiest_rank_paces_every_rank() -> None:
    async def scenario(per_rank: list[int]) -> tuple[float, float]:
        d = SimWorker("regular", SimParams(dp_size=4, time_scale=0.01, sample_interval_s=0.0))
        await d.start()
        try:
            conns = []
            tasks = []
            for rank, n in enumerate(per_rank):
                for _ in range(n):
                    c = HttpConnection(H, d.port)
                    conns.append(c)
                    tasks.append(c.request("POST", "/generate", gen_body(200_000, 20, routed_dp_rank=rank)))
            await asyncio.gather(*tasks)
            for c in conns:
                c.close()
            return max(s[1] for s in d.decode.samples), d.decode.steps
        finally:
            await d.stop()

    light, _ = run(scenario([1, 1, 1, 1]))
    heavy, steps = run(scenario([1, 1, 1, 5]))  # same lone request on ranks 0-2, a hot rank 3
    p = SimParams()
    assert heavy > light
    assert heavy == pytest.approx(p.step_base_ms + p.step_seconds(5, 5 * 200_000), abs=0.05)
    assert steps >= 20


def test_loadgen_mini_router_end_to_end() -> None:
    async def scenario() -> dict:
        c = await start_cluster(params=SimParams(dp_size=4, time_scale=0.02))
        try:
            p, d = c.prefills[0], c.decodes[0]
            trace = [TraceItem(2_000 + 1000 * i, 20 + i) for i in range(10)]
            res = await run_load(
                Target(H, d.port, prefill=(H, p.port, p.bootstrap_port)), trace, 8, duration_s=1.5, warmup_s=0.2
            )
            s = res.summary()
            await until(lambda: all(x == (0, 0, 0) for x in d.rank_loads()), what="decode drained")
            s["prefill_completed"] = p.prefill.completed
            s["placed"] = d.decode.placed
            return s
        finally:
            await c.stop()

    s = run(scenario())
    assert s["errors"] == 0 and s["completed"] > 5 and s["completed_total"] <= s["prefill_completed"]
    assert s["output_tok_s"] > 0 and s["ttft_p50_ms"] > 0 and s["tpot_p50_ms"] > 0
    assert s["interactivity_p50"] >= s["interactivity_p90"]
    assert max(s["placed"]) - min(s["placed"]) <= 1  # the decode's own round-robin


@pytest.mark.skipif(
    importlib.util.find_spec("fastroute.runtime.server") is None,
    reason="the router (fastroute.runtime.server) is not importable in this install",
)
def test_demo_runs_end_to_end(tmp_path) -> None:
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "fastroute",
        "demo",
        "--duration",
        "10",
        "--warmup",
        "0.5",
        "--concurrency",
        "8",
        "--time-scale",
        "0.05",
        "--out",
        str(out),
        "--quiet",
        "--conversation-rate",
        "2",
    ]
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "never retrieved" not in proc.stderr, proc.stderr[-3000:]
    assert "| round_robin |" in proc.stdout and "| demand W=1e+06 |" in proc.stdout
    # the conversation part: the default policy beside least_requests, with the prefix hit rate
    conv = [ln for ln in proc.stdout.splitlines() if ln.startswith("| bursty |")]
    assert [ln.split(" | ")[1] for ln in conv] == [
        "default (cache_aware)",
        "least_requests",
        "cache_aware, affinity on decode too",
    ], conv
    assert all(ln.split(" | ")[-3].endswith("%") for ln in conv), conv
    results = json.loads((out / "balance.json").read_text())
    assert [r["label"] for r in results] == [
        "round_robin",
        "p2c least_requests",
        "demand W=1e+06",
        "no --dp-aware, SGLang total_requests",
    ]
    for r in results:
        assert r["load"]["completed_total"] > 0 and r["load"]["errors"] == 0, r
        assert r["balance"]["samples"] > 0
    assert (out / "balance.md").exists()
    assert "out tok/s (simulated)" in proc.stdout
    empty = [p for p in out.rglob("*") if p.is_file() and p.stat().st_size == 0]
    assert not empty, empty  # no empty router log left behind
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "outstanding_c8.png").stat().st_size > 1000


def test_worker_cli_processes_rendezvous_over_the_bootstrap_port() -> None:
    """Prefill and decode as separate `python -m fastroute.sim.worker` processes."""
    import socket

    def free() -> int:
        with socket.socket() as s:
            s.bind((H, 0))
            return s.getsockname()[1]

    pp, boot, dp = free(), free(), free()
    common = [sys.executable, "-m", "fastroute.sim.worker", "--dp-size", "2", "--time-scale", "0.01"]
    procs = [
        subprocess.Popen(
            common + ["--role", "prefill", "--port", str(pp), "--bootstrap-port", str(boot)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            common + ["--role", "decode", "--port", str(dp)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        ),
    ]
    try:

        async def scenario() -> None:
            for port in (pp, dp):

                async def up(port: int = port) -> bool:
                    try:
                        return (await fetch(H, port, "GET", "/health", timeout=1.0))[0] == 200
                    except Exception:
                        return False

                for _ in range(200):
                    if await up():
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"sim worker on {port} did not come up")
            body = gen_body(30, 2, bootstrap_host=H, bootstrap_port=boot, bootstrap_room=99, routed_dp_rank=1)
            (ps, pb), (ds, db) = await asyncio.gather(
                fetch(H, pp, "POST", "/generate", body), fetch(H, dp, "POST", "/generate", body)
            )
            assert ps == 200 and ds == 200 and json.loads(db)["meta_info"]["completion_tokens"] == 2
            st, stats = await get_json(dp, "/sim/stats")
            assert stats["placed"] == [0, 1] and stats["completed"] == 1

        run(scenario())
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def test_batches_rendezvous_per_item_and_answer_per_item() -> None:
    async def scenario() -> None:
        c = await start_cluster(params=SimParams(dp_size=4, time_scale=0.01))
        try:
            p, d = c.prefills[0], c.decodes[0]
            body = json.dumps(
                {
                    "input_ids": [[1] * 10, [1] * 20, [1] * 30],
                    "bootstrap_host": [H] * 3,
                    "bootstrap_port": [p.bootstrap_port] * 3,
                    "bootstrap_room": [7, 9, 12],
                    "routed_dp_rank": [3, 3, 1],
                    "sampling_params": {"max_new_tokens": 2},
                }
            ).encode()
            (ps, pb), (ds, db) = await asyncio.gather(
                fetch(H, p.port, "POST", "/generate", body), fetch(H, d.port, "POST", "/generate", body)
            )
            assert ps == 200 and len(json.loads(pb)) == 3
            assert ds == 200
            out = json.loads(db)
            assert [o["meta_info"]["prompt_tokens"] for o in out] == [10, 20, 30]
            assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 2, 2]
            assert d.decode.placed == [0, 1, 0, 2] and p.prefill.completed == 3

            # Streaming completions batch with a scalar room: rooms room, room+1 on both legs.
            body = json.dumps(
                {
                    "prompt": ["abcd" * 5, "abcd" * 6],
                    "max_tokens": 3,
                    "stream": True,
                    "bootstrap_host": H,
                    "bootstrap_port": p.bootstrap_port,
                    "bootstrap_room": 100,
                }
            ).encode()
            got: list[bytes] = []
            dconn = HttpConnection(H, d.port)
            (ps, _), (ds, _, _) = await asyncio.gather(
                fetch(H, p.port, "POST", "/v1/completions", body),
                dconn.request("POST", "/v1/completions", body, on_chunk=got.append),
            )
            dconn.close()
            events = [json.loads(e[6:]) for e in b"".join(got).split(b"\n\n") if e.startswith(b"data: {")]
            assert ps == 200 and ds == 200
            assert sorted(e["choices"][0]["index"] for e in events) == [0, 0, 0, 1, 1, 1]

            # A batch whose second room never comes back fails as a whole and frees everything.
            d.p.rendezvous_timeout_s = 0.3
            body = json.dumps(
                {
                    "text": ["a", "b"],
                    "bootstrap_host": H,
                    "bootstrap_port": p.bootstrap_port,
                    "bootstrap_room": [500, 501],
                }
            ).encode()
            one = json.dumps(
                {"text": "a", "bootstrap_room": 500, "bootstrap_host": H, "bootstrap_port": p.bootstrap_port}
            ).encode()
            (ps, _), (ds, db) = await asyncio.gather(
                fetch(H, p.port, "POST", "/generate", one), fetch(H, d.port, "POST", "/generate", body)
            )
            assert ps == 200 and ds == 500 and b"501" in db
            await until(lambda: all(x == (0, 0, 0) for x in d.rank_loads()), what="batch freed")
        finally:
            await c.stop()

    run(scenario())
