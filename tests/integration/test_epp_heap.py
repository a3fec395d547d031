"""The picker's start-up heap out of the garbage collector's sight, as the proxy's: each
collection then walks only what the ext_proc streams made since, not the modules, protobuf
descriptors, registry and target table views start-up made (a gen-2 collection over those ran
every few thousand streams and cost a share of every decision)."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Iterator

import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

import grpc  # noqa: E402

from fastroute.runtime import heap  # noqa: E402
from tests.integration.conftest import run, until, workers  # noqa: E402
from tests.integration.test_epp_grpc import in_flight, picked_on_headers, start_epp  # noqa: E402


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(heap, "QUIET_SECS", 0.2)
    try:
        yield
    finally:
        gc.unfreeze()  # give the test process its collector back


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


def test_a_worker_added_later_is_frozen_once_the_set_settles(quick: None) -> None:
    async def body() -> None:
        gc.unfreeze()
        w1, w2 = await workers(2)
        epp = await start_epp(w1, policy="round_robin")
        try:
            epp.registry.add_worker(w2.url, "regular")
            await until(lambda: len(epp.registry.group("regular").targets) == 2, 10, "second worker ready")
            added = epp.registry.find(w2.url)
            assert added is not None and gc.is_tracked(added)
            # registered after start-up: frozen once the worker set has been quiet a while
            await until(lambda: not _tracked(added), 10, "the added worker frozen")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
                calls = [await picked_on_headers(ch) for _ in range(2)]  # both workers picked
                assert in_flight(epp) == 2 and w2.url in {wk.url for wk in epp.registry.workers}
                for call in calls:
                    call.cancel()
        finally:
            await epp.stop(grace=0.5)

    run(body(), 60)


def test_a_stopped_picker_leaves_no_engine_event_context_open() -> None:
    """--kv-events auto (the default) opens a ZMQ context for the engines' pushed events; the
    picker's stop closes it as the proxy's does, instead of leaving it to a later collection
    (which warned "Unclosed context" in whatever test or request happened to be running)."""

    async def body() -> None:
        (w,) = await workers(1)
        epp = await start_epp(w, policy="round_robin")
        assert epp.parts is not None and epp.parts.kv_events is not None
        await epp.stop(grace=0.5)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        run(body(), 60)
        gc.unfreeze()  # the picker froze its heap: let the collector see the context again
        gc.collect()
    unclosed = [str(w.message) for w in seen if "Unclosed context" in str(w.message)]
    assert not unclosed, unclosed
