"""The picker's start-up heap out of the garbage collector's sight, as the proxy's: each
collection then walks only what the ext_proc streams made since, not the modules, protobuf
descriptors, registry and target table views start-up made (a gen-2 collection over those ran
every few thousand streams and cost a share of every decision)."""

from __future__ import annotations

import gc

import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

import grpc  # noqa: E402

from tests.integration.conftest import run, workers  # noqa: E402
from tests.integration.test_epp_grpc import in_flight, picked_on_headers, start_epp  # noqa: E402


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


def test_the_pickers_start_up_heap_is_out_of_the_collectors_sight() -> None:
    async def body() -> None:
        gc.unfreeze()
        (w,) = await workers(1)
        epp = await start_epp(w, policy="round_robin")
        try:
            assert gc.get_freeze_count() > 0
            # what start-up made is frozen: the decider, the processor, the registry
            for obj in (epp.decider, epp.processor, epp.registry):
                assert gc.is_tracked(obj) and not _tracked(obj), type(obj).__name__
            async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
                call = await picked_on_headers(ch)  # the picker still decides
                assert in_flight(epp) == 1
                call.cancel()
        finally:
            await epp.stop(grace=0.5)
            gc.unfreeze()

    run(body(), 60)
