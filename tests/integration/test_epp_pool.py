"""``fastroute epp --inference-pool``: the picker's targets from an InferencePool, over real
sockets. The Kubernetes API stand-in (kubeapi.py, the real list/watch wire format) serves the
pool and its pods through a kubeconfig in $KUBECONFIG; fake SGLang workers listen on
127.0.0.2, 127.0.0.3 ... (the pod IPs), each on the pool's target ports; the picker's EppServer
runs in this event loop and its picks are asked over its real gRPC ext_proc listener."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from conftest import call, post, run, until  # noqa: E402
from kubeapi import KubeApi, inference_pool, pod  # noqa: E402
from test_discovery import PodWorker, kube_env, pod_workers  # noqa: E402,F401

from fastroute.config import Config  # noqa: E402
from fastroute.config.cli import main  # noqa: E402
from fastroute.epp.server import EppServer  # noqa: E402
from tests.integration.envoy_harness import Gateway, free_port  # noqa: E402

NS = "team-a"


async def second_port(ws: list[PodWorker]) -> list[PodWorker]:
    """Another worker on each pod IP of ``ws``, all on one more common port."""
    for _ in range(20):
        out: list[PodWorker] = []
        try:
            first = await PodWorker(ws[0].ip).start()
            out.append(first)
            for w in ws[1:]:
                out.append(await PodWorker(w.ip, first.port).start())
            return out
        except OSError:
            for w in out:
                await w.stop()
    raise RuntimeError("no second common port")


async def start(api: KubeApi, kubeconfig: Any, pool: str = "llama") -> EppServer:
    kubeconfig.write_text(api.kubeconfig())
    cfg = Config(
        host="127.0.0.1",
        policy="round_robin",
        worker_startup_check_interval=1,
        disable_health_check=True,
        shutdown_grace_period_secs=1,
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        discovery_check_interval_secs=30,
    )
    server = EppServer(cfg, free_port(), pool=pool, pool_namespace=NS)
    await server.start()
    return server


def urls(server: EppServer) -> set[str]:
    return {w.url for w in server.registry.workers if w.status == "ready"}


async def pick(server: EppServer) -> str:
    """One request through the picker's gRPC listener: the endpoint it names (or the status
    of its refusal)."""
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    hm = pb.HttpHeaders(end_of_stream=True)
    for k, v in {":method": "GET", ":path": "/v1/models", ":authority": "gw"}.items():
        hm.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        call = pb_grpc.ExternalProcessorStub(ch).Process()
        await call.write(pb.ProcessingRequest(request_headers=hm))
        ans = await asyncio.wait_for(call.read(), 5)
        await call.done_writing()
        if ans.WhichOneof("response") == "immediate_response":
            return str(ans.immediate_response.status.code)
        sets = ans.request_headers.response.header_mutation.set_headers
        return {h.header.key: h.header.raw_value.decode() for h in sets}["x-gateway-destination-endpoint"]


def test_pool_pods_become_targets_on_every_port_and_follow_the_pool(kube_env: Any) -> None:
    async def body() -> None:
        api = await KubeApi().start()
        ws = await pod_workers(3)
        more = await second_port(ws)
        a, b, c = ws
        p1, p2 = a.port, more[0].port
        await api.put(pod("a", a.ip))
        await api.put(pod("b", b.ip))
        await api.put(pod("c", c.ip, labels={"app": "other"}))
        await api.put(pod("x", a.ip, ns="elsewhere"))  # the pool selects in its own NS
        await api.put(inference_pool("llama", {"app": "sglang"}, [p1]))
        await api.put(inference_pool("unrelated", {"app": "other"}, [p2]))
        server = await start(api, kube_env)
        try:
            await until(lambda: urls(server) == {a.url, b.url}, 10, "the pool's pods")
            assert server.ready()
            got = {await pick(server) for _ in range(4)}
            assert got == {f"{a.ip}:{p1}", f"{b.ip}:{p1}"}
            w = server.registry.find(a.url)
            assert w.labels == {"discovery": "inferencepool", "source": f"{NS}/a"}

            # a second target port: every pod is a target on each
            await api.put(inference_pool("llama", {"app": "sglang"}, [p1, p2]))
            both = {f"http://{ip}:{p}" for ip in (a.ip, b.ip) for p in (p1, p2)}
            await until(lambda: urls(server) == both, 10, "targets on both ports")
            got = {await pick(server) for _ in range(8)}
            assert len(got) == 4

            # the selector changes: only c's pods now, on both ports
            await api.put(inference_pool("llama", {"app": "other"}, [p1, p2]))
            await until(
                lambda: urls(server) == {f"http://{c.ip}:{p1}", f"http://{c.ip}:{p2}"}, 10, "the new selector's pods"
            )

            # a pod of the pool that is not Ready leaves; back to the first port only
            await api.put(pod("c", c.ip, labels={"app": "other"}, ready=False))
            await until(lambda: urls(server) == set(), 10, "c unready")
            await api.put(pod("c", c.ip, labels={"app": "other"}))
            await api.put(inference_pool("llama", {"app": "other"}, [p1]))
            await until(lambda: urls(server) == {f"http://{c.ip}:{p1}"}, 10, "c on p1")

            # the pool the picker cannot serve, then deleted: no endpoints, 503, not ready
            await api.put(inference_pool("llama", {"app": "other"}, [p1], appProtocol="kubernetes.io/h2c"))
            await until(lambda: not server.registry.workers, 10, "h2c pool: no endpoints")
            await api.put(inference_pool("llama", {"app": "sglang"}, [p1]))
            await until(lambda: urls(server) == {a.url, b.url}, 10, "usable again")
            await api.delete(NS, "llama", kind="InferencePool")
            await until(lambda: not server.registry.workers, 10, "pool deleted")
            await until(lambda: not server.ready(), 5, "not ready")
            assert await pick(server) == "503"
            # the pool is asked for by name in its namespace; pods only with its selector
            paths = {p for _, p, _ in api.requests}
            assert paths == {
                f"/api/v1/namespaces/{NS}/pods",
                f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools",
            }
            assert {q.get("fieldSelector") for _, p, q in api.requests if p.endswith("inferencepools")} == {
                "metadata.name=llama"
            }
            assert {q.get("labelSelector") for _, p, q in api.requests if p.endswith("pods")} == {
                "app=sglang",
                "app=other",
            }
        finally:
            await server.stop(grace=0.2)
            await api.stop()
            for w in ws + more:
                await w.stop()

    run(body(), 90)


def test_a_pool_created_after_the_start_is_picked_up(kube_env: Any) -> None:
    async def body() -> None:
        api = await KubeApi().start()
        (a,) = await pod_workers(1)
        await api.put(pod("a", a.ip))
        server = await start(api, kube_env)
        try:
            await asyncio.sleep(0.3)
            assert not server.registry.workers and not server.ready()
            await api.put(inference_pool("llama", {"app": "sglang"}, [a.port]))
            await until(lambda: urls(server) == {a.url}, 10, "the pool appeared")
            await until(server.ready, 5, "ready")
        finally:
            await server.stop(grace=0.2)
            await api.stop()
            await a.stop()

    run(body(), 60)


def test_a_forbidden_pool_is_logged_with_the_rbac_hint_and_retried(kube_env: Any, caplog: Any) -> None:
    async def body() -> None:
        api = await KubeApi().start()
        (a,) = await pod_workers(1)
        await api.put(pod("a", a.ip))
        await api.put(inference_pool("llama", {"app": "sglang"}, [a.port]))
        api.status = 403
        server = await start(api, kube_env)
        try:
            await until(lambda: "inferencepools.inference.networking.k8s.io" in caplog.text, 10, "the RBAC hint")
            assert not server.registry.workers
            api.status = None  # the Role was fixed: the backoff retries
            await until(lambda: urls(server) == {a.url}, 15, "the pool after the fix")
        finally:
            await server.stop(grace=0.2)
            await api.stop()
            await a.stop()

    with caplog.at_level("WARNING", logger="fastroute.epp.pool"):
        run(body(), 60)


def test_a_pool_watch_that_410s_forever_backs_off_logs_once_and_keeps_its_workers(kube_env: Any, caplog: Any) -> None:
    """The pool is followed by the same list/watch loop as pods (control/kube_watch.py): an
    API that answers 410 to every watch is listed again with a growing wait, said once."""

    async def body() -> None:
        api = await KubeApi().start()
        (a,) = await pod_workers(1)
        await api.put(pod("a", a.ip))
        await api.put(inference_pool("llama", {"app": "sglang"}, [a.port]))
        server = await start(api, kube_env)
        try:
            await until(lambda: urls(server) == {a.url}, 10, "the pool's pod")
            api.floor = 10**9  # every watch is too old: an API that 410s forever
            await api.kick()
            t0 = asyncio.get_running_loop().time()

            def pool_lists() -> list[float]:
                return [
                    t
                    for t, p, q in api.requests
                    if t > t0 and p.endswith("inferencepools") and q.get("watch") != "true"
                ]

            await until(lambda: len(pool_lists()) >= 4, 20, "four lists of the pool")
            lists = pool_lists()
            gaps = [y - x for x, y in zip(lists, lists[1:])]
            assert gaps[2] > gaps[0] * 1.5  # the wait grows (jitter is +-20 %)
            gone = [r for r in caplog.records if "410 Gone" in r.getMessage() and "InferencePool" in r.getMessage()]
            assert len(gone) == 1, [r.getMessage() for r in gone]
            assert urls(server) == {a.url}  # the workers are kept meanwhile
            api.floor = 0  # the API recovers: a deleted pool is followed again
            await api.delete(NS, "llama", kind="InferencePool")
            await until(lambda: not server.registry.workers, 20, "the pool deleted after the 410s")
        finally:
            await server.stop(grace=0.2)
            await api.stop()
            await a.stop()

    with caplog.at_level("INFO", logger="fastroute.epp.pool"):
        run(body(), 60)


def test_the_pool_flags_are_checked(kube_env: Any, capsys: Any, monkeypatch: Any) -> None:
    base = ["epp", "--grpc-port", "9002"]
    assert main([*base, "--inference-pool-namespace", "ns"]) == 2
    assert "argument --inference-pool-namespace" in capsys.readouterr().err
    assert main([*base, "--inference-pool", "Not_A_Name"]) == 2
    assert "argument --inference-pool" in capsys.readouterr().err
    assert main([*base, "--inference-pool", "p"]) == 2  # no kubeconfig at all
    assert "argument --inference-pool: no Kubernetes configuration" in capsys.readouterr().err
    kube_env.write_text("{}")
    assert (
        main([*base, "--inference-pool", "p", "--discovery-provider", "file", "--discovery-file", "/nonexistent.json"])
        == 2
    )
    assert "argument --inference-pool:" in capsys.readouterr().err


def test_through_envoy_the_picker_process_routes_to_the_pool(kube_env: Any) -> None:
    async def body() -> None:
        api = await KubeApi().start()
        kube_env.write_text(api.kubeconfig())
        a, b = await pod_workers(2)
        await api.put(pod("a", a.ip))
        await api.put(pod("b", b.ip))
        await api.put(inference_pool("llama", {"app": "sglang"}, [a.port]))
        try:
            async with Gateway(
                [], "--inference-pool", "llama", "--inference-pool-namespace", NS, "--policy", "round_robin"
            ) as g:
                for i in range(4):
                    r = await call(g.port, post("/generate", {"text": f"r{i}"}), timeout=10)
                    assert r.status == 200
                assert len(a.inference()) == 2 and len(b.inference()) == 2
                await api.delete(NS, "b")
                await g.until_in_flight(lambda f: set(f) == {a.url}, 10, "b gone")
                for i in range(2):
                    r = await call(g.port, post("/generate", {"text": f"s{i}"}), timeout=10)
                    assert r.status == 200
                assert len(a.inference()) == 4 and len(b.inference()) == 2
        finally:
            await api.stop()
            for w in (a, b):
                await w.stop()

    run(body(), 90)
