"""The picker's own CPU per decision in gRPC mode, without grpcio.

``bench/epp.py`` measures the picker process through Envoy: grpcio's stream machinery and the
picker's code together (its ``envoy+grpcstub`` row is grpcio alone). This runs the picker's
ext_proc servicer (:class:`fastroute.epp.service.ExternalProcessor` of a started
:class:`fastroute.epp.server.EppServer`, power_of_two on requests as bench/epp.py, a fake worker
on loopback) over an in-memory stream: each stream reads the request headers Envoy sends, is
picked and booked, reads the response headers, ends and releases, exactly the messages of the
printed bootstrap, with reads and writes that cost nothing. CPU time per stream is what the
picker adds on top of grpcio.

Usage: ``python bench/epp_own_cost.py [--streams N] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import uvloop
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastroute.config import Config  # noqa: E402
from fastroute.epp.server import EppServer  # noqa: E402
from tests.integration.conftest import until, workers  # noqa: E402
from tests.integration.envoy_harness import free_port  # noqa: E402

# What Envoy sends for a JSON POST /generate relayed through the printed bootstrap.
REQUEST_HEADERS = {
    ":authority": "127.0.0.1:8080",
    ":path": "/generate",
    ":method": "POST",
    ":scheme": "http",
    "content-type": "application/json",
    "content-length": "64",
    "user-agent": "wrk",
    "x-forwarded-proto": "http",
    "x-request-id": "3f2a0e8c-1111-2222-3333-444455556666",
}
RESPONSE_HEADERS = {":status": "200", "content-type": "application/json", "content-length": "512"}


def _headers(items: dict[str, str]) -> Any:
    return pb.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in items.items()]
        )
    )


class MemoryStream:
    """The servicer's side of one stream: ``read`` hands out the messages, then EOF."""

    __slots__ = ("messages", "next")

    def __init__(self, messages: list[Any]) -> None:
        self.messages = messages
        self.next = 0

    async def read(self) -> Any:
        i = self.next
        self.next = i + 1
        return self.messages[i] if i < len(self.messages) else grpc.aio.EOF

    async def write(self, message: Any) -> None:
        pass

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"


async def measure(streams: int, rounds: int) -> list[float]:
    (worker,) = await workers(1)
    cfg = Config(
        host="127.0.0.1",
        worker_urls=[worker.url],
        worker_startup_check_interval=1,
        disable_health_check=True,
        policy="power_of_two",
        p2c_load_metric="requests",
    )
    epp = EppServer(cfg, free_port())
    await epp.start()
    try:
        await until(epp.ready, 10, "picker ready")
        assert epp.processor is not None and epp.decider is not None
        messages = [
            pb.ProcessingRequest(request_headers=_headers(REQUEST_HEADERS)),
            pb.ProcessingRequest(response_headers=_headers(RESPONSE_HEADERS)),
        ]
        per_stream = []
        for _ in range(rounds):
            t0 = time.process_time()
            for _ in range(streams):
                await epp.processor.Process(None, MemoryStream(messages))
            per_stream.append((time.process_time() - t0) / streams * 1e6)
        if epp.decider.in_flight:
            raise SystemExit(f"{epp.decider.in_flight} bookings left open")
        return per_stream
    finally:
        await epp.stop(grace=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    runs = uvloop.run(measure(args.streams, args.rounds))
    print("picker's own CPU per decision (us), per round: " + ", ".join(f"{us:.1f}" for us in runs))
    print(f"median: {sorted(runs)[len(runs) // 2]:.1f} us")


if __name__ == "__main__":
    main()
