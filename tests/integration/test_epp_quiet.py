"""``--silent-stream-timeout-secs 0`` through a real Envoy: with no silence bound and no served
report to read, a pick made on the headers tells Envoy to skip the response headers as well
(one ext_proc message and answer fewer per request, counted in Envoy's own ext_proc stats);
leases still end with the stream."""

from __future__ import annotations

import re

from tests.integration.conftest import call, get, post, run, workers
from tests.integration.envoy_harness import Gateway


async def _sent(g: Gateway) -> int:
    r = await call(g.admin_port, get("/stats?filter=ext_proc"), timeout=5)
    hit = re.search(rb"ext_proc\.stream_msgs_sent: (\d+)", r.body)
    assert hit, r.body
    return int(hit.group(1))


def test_no_silence_bound_skips_the_response_headers_message() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        for flags, per_request in ((("--silent-stream-timeout-secs", "0"), 1), ((), 2)):
            async with Gateway([w.url], "--policy", "round_robin", *flags) as g:
                for i in range(5):
                    r = await call(g.port, post("/generate", {"text": f"q{i}"}), timeout=10)
                    assert r.status == 200, r.body
                await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "released at the stream's end")
                assert await _sent(g) == 5 * per_request, flags

    run(body(), 90)
