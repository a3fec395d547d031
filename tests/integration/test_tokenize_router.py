"""Exact tokens through the router (``--tokenizer-path``): a chat request is rendered and
tokenized before its pick, matched against a rank's KV events, and sent unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from fastroute.runtime.startup import StartupError
from tests.integration.conftest import Router, call, post, run, until
from tests.integration.test_kv_events import BS, Engine, KvWorker, index_of, last_rank, rows, stored, subscribed
from tests.tokenizer_fixture import build, ids


def _chat(words: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "you are a bot"}, {"role": "user", "content": words}]}


def test_a_chat_prompt_goes_to_the_rank_holding_its_rendered_tokens(tmp_path) -> None:
    path = build(str(tmp_path / "tok"))

    async def go() -> None:
        e = Engine()
        w = await KvWorker(e).start()
        try:
            async with Router(
                worker_urls=[w.url],
                dp_aware=True,
                policy="cache_aware",
                load_monitor_interval=3600.0,
                seed=3,
                tokenizer_path=(path,),
            ) as r:
                await subscribed(r, w)
                words = " ".join(f"w{i}" for i in range(120))
                prompt = ids("<s>", "<|im_start|>", "system", "you", "are", "a", "bot", "<|im_end|>")
                prompt += ids("<|im_start|>", "user", *words.split(), "<|im_end|>", "<|im_start|>", "assistant")
                n = len(prompt) // BS
                blocks = [prompt[i * BS : (i + 1) * BS] for i in range(n)]
                await e.publish(4, [stored(list(range(1, n + 1)), None, blocks)])
                t4 = rows(r, w)[4]
                idx = index_of(r)
                await until(lambda: idx.blocks(t4) == n, 5.0, "blocks on rank 4")
                body = post("/v1/chat/completions", _chat(words))
                for _ in range(3):
                    resp = await call(r.port, body)
                    assert resp.status == 200, resp.body
                    assert last_rank(w) == 4
                    sent = w.inference()[-1].json
                    assert sent["messages"] == _chat(words)["messages"]  # the prompt is not rewritten
                tokens = r.server.app.endpoints.tokens
                assert tokens.exact["inline"] + tokens.exact["pool"] == 3
                # Another conversation shares only the system turn: no block of rank 4 matches.
                resp = await call(r.port, post("/v1/chat/completions", _chat("hello world")))
                assert resp.status == 200
        finally:
            await w.stop()
            await e.close()

    run(go())


def test_a_broken_template_serves_the_request_with_the_estimate(tmp_path) -> None:
    path = build(str(tmp_path / "tok"), template="{{ raise_exception('nope') }}")

    async def go() -> None:
        e = Engine()
        w = await KvWorker(e).start()
        try:
            async with Router(worker_urls=[w.url], dp_aware=True, policy="cache_aware", tokenizer_path=(path,)) as r:
                resp = await call(r.port, post("/v1/chat/completions", _chat("hello")))
                assert resp.status == 200
                assert r.server.app.endpoints.tokens.fallbacks["template"] == 1
                from tests.integration.test_kv_events import metrics

                body = await metrics(r)
                assert 'fastroute_tokenized_requests_total{outcome="template"} 1.0' in body
        finally:
            await w.stop()
            await e.close()

    run(go())


def test_an_unusable_tokenizer_path_stops_the_start_naming_the_file(tmp_path) -> None:
    async def go() -> None:
        r = Router(worker_urls=["http://127.0.0.1:1"], policy="cache_aware", tokenizer_path=(str(tmp_path),))
        with pytest.raises(StartupError, match="tokenizer.json: missing"):
            await r.server.start()

    run(go())


def test_nothing_reads_tokens_then_nothing_is_tokenized(tmp_path, caplog) -> None:
    path = build(str(tmp_path / "tok"))

    async def go() -> None:
        e = Engine()
        w = await KvWorker(e).start()
        try:
            async with Router(worker_urls=[w.url], policy="round_robin", tokenizer_path=(path,)) as r:
                assert r.server.app.endpoints.tokens is None
                resp = await call(r.port, post("/generate", {"text": "hello"}))
                assert resp.status == 200
        finally:
            await w.stop()
            await e.close()

    run(go())
    assert sum("--tokenizer-path is accepted and not used" in rec.getMessage() for rec in caplog.records) == 1


def test_chat_through_the_simulator_tokenizing_as_sglang_does(tmp_path) -> None:
    """Router and simulated PD servers share the tokenizer: a chat prompt's blocks stored by the
    prefill (as events) are found for the next turn of the conversation."""
    from fastroute.sim.engine import SimParams
    from fastroute.sim.worker import start_cluster

    path = build(str(tmp_path / "tok"))

    async def go() -> None:
        prefill = SimParams(
            dp_size=8,
            time_scale=0.01,
            prefix_cache_tokens=64 * BS,
            prefix_block_tokens=BS,
            kv_events_port_base=-1,
            tokenizer_path=path,
        )
        cluster = await start_cluster(1, 1, SimParams(dp_size=8, time_scale=0.01, tokenizer_path=path), prefill)
        pe = cluster.prefills[0].prefill
        p, d = cluster.prefills[0], cluster.decodes[0]
        try:
            async with Router(
                pd_disaggregation=True,
                prefill=[(p.url, p.bootstrap_port)],
                decode=[d.url],
                dp_aware=True,
                policy="cache_aware",
                load_monitor_interval=3600.0,
                tokenizer_path=(path,),
                seed=9,
            ) as r:
                idx = r.server.router.kv_index
                w = r.server.registry.find(p.url)
                await until(lambda: all(idx.state(t) == "fresh" for t in w.targets), 10.0, "subscribed")
                msgs = [{"role": "system", "content": "you are a bot"}]
                msgs.append({"role": "user", "content": " ".join(f"w{i}" for i in range(100))})
                resp = await call(r.port, post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}))
                assert resp.status == 200, resp.body
                await until(lambda: sum(idx.blocks(t) for t in w.targets) > 0, 5.0, "stored blocks")
                held = [i for i, t in enumerate(w.targets) if idx.blocks(t)]
                hits0 = pe.hit_tokens
                msgs += [{"role": "assistant", "content": "fine"}, {"role": "user", "content": "how are you ?"}]
                resp = await call(r.port, post("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}))
                assert resp.status == 200, resp.body
                assert held and pe.hit_tokens - hits0 >= 6 * BS  # the first turn's blocks were found
                assert idx.picks == 2 and idx.fallbacks["no_ids"] == 0
        finally:
            await cluster.stop()

    run(go(), timeout=60)
