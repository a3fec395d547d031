"""Worker discovery over real sockets: a Kubernetes API stand-in (tests/integration/kubeapi.py)
reached through a kubeconfig in $KUBECONFIG, fake SGLang workers on 127.0.0.2, 127.0.0.3, ...
all on one port, and the router's Server in this event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from typing import Any

import pytest
from conftest import DataWorker, _WorkerConn, call, get, post, run, until
from kubeapi import KubeApi, pod

from fastroute.config import Config, ConfigError
from fastroute.runtime.server import Server

NS = "team-a"


class PodWorker(DataWorker):
    """A DataWorker bound to its own loopback address (a pod IP) on a shared port."""

    def __init__(self, ip: str, port: int = 0, **kw: Any) -> None:
        super().__init__(**kw)
        self.ip = ip
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    async def start(self) -> PodWorker:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _WorkerConn(self), self.ip, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self


async def pod_workers(n: int, **kw: Any) -> list[PodWorker]:
    """n workers on 127.0.0.2 .. 127.0.0.(n+1), all on the port the first one got."""
    for _ in range(20):
        first = await PodWorker("127.0.0.2", **kw).start()
        out = [first]
        try:
            for i in range(1, n):
                out.append(await PodWorker(f"127.0.0.{i + 2}", first.port, **kw).start())
            return out
        except OSError:  # that port is taken on another loopback address: try another
            for w in out:
                await w.stop()
    raise RuntimeError("no common free port on the loopback addresses")


@pytest.fixture
def kube_env(tmp_path, monkeypatch):
    """Point $KUBECONFIG at a file the test fills in once the stand-in has a port."""
    path = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return path


async def start(api: KubeApi, kubeconfig, pods_port: int, **cfg: Any) -> Server:
    kubeconfig.write_text(api.kubeconfig())
    cfg.setdefault("service_discovery", True)
    cfg.setdefault("selector", ["app=sglang"])
    cfg.setdefault("service_discovery_namespace", NS)
    cfg = {
        **dict(
            host="127.0.0.1",
            port=0,
            policy="round_robin",
            worker_startup_check_interval=1,
            disable_health_check=True,
            shutdown_grace_period_secs=1,
            prometheus_host="127.0.0.1",
            prometheus_port=0,
            service_discovery_port=pods_port,
            discovery_check_interval_secs=30,
        ),
        **cfg,
    }
    server = Server(Config(**cfg))
    await server.start()
    return server


async def stop_all(server: Server, api: Any, workers: list[PodWorker]) -> None:
    """A test's teardown: the router, then the API stand-in, then the pod workers."""
    await server.stop(grace=0.5)
    await api.stop()
    for w in workers:
        await w.stop()


def urls(server: Server, status: str = "ready") -> set[str]:
    return {w.url for w in server.registry.workers if w.status == status}


async def timed(cond, what: str) -> float:
    """Seconds until cond() holds (bounded at the issue's 15 s)."""
    t0 = time.perf_counter()
    await until(cond, 15.0, what)
    return time.perf_counter() - t0


def test_only_ready_running_matching_pods_become_workers_and_follow_changes(kube_env, capsys):
    async def body():
        api = await KubeApi().start()
        ws = await pod_workers(6)
        a, b, c, d, e, f = ws
        port = a.port
        await api.put(pod("a", a.ip))  # usable
        await api.put(pod("b", b.ip, ready=False))  # not Ready yet
        await api.put(pod("c", c.ip, phase="Pending"))  # not Running
        await api.put(pod("nip", None))  # no pod IP
        await api.put(pod("d", d.ip, ns="other"))  # other namespace
        await api.put(pod("e", e.ip, labels={"app": "vllm"}))  # selector mismatch
        await api.put(pod("f", f.ip, deleting=True))  # being deleted
        server = await start(api, kube_env, port)
        try:
            await until(lambda: urls(server) == {a.url}, 10.0, "pod a registered")
            await asyncio.sleep(0.3)  # nothing else trickles in
            assert {w.url for w in server.registry.workers} == {a.url}
            w = server.registry.find(a.url)
            assert w.labels == {"discovery": "kubernetes", "source": f"{NS}/a"}

            # requests flow through the discovered worker
            r = await call(server.port, post("/generate", {"text": "hi"}))
            assert r.status == 200 and len(a.inference()) == 1

            # b turns Ready: added (and ready) within the target second
            await api.put(pod("b", b.ip))
            added = await timed(lambda: b.url in urls(server), "b ready")
            r = await call(server.port, post("/generate", {"text": "hi"}))
            r2 = await call(server.port, post("/generate", {"text": "hi"}))
            assert r.status == r2.status == 200 and len(b.inference()) >= 1

            # a deleted, b no longer Ready, a relabelled c-turned-Running pod never matches
            await api.delete(NS, "a")
            removed = await timed(lambda: a.url not in urls(server), "a removed")
            await api.put(pod("b", b.ip, ready=False))
            unready = await timed(lambda: b.url not in urls(server), "b removed")
            await api.put(pod("c", c.ip))
            await until(lambda: c.url in urls(server), 15.0, "c ready")
            await api.put(pod("c", c.ip, labels={"app": "other"}))
            relabel = await timed(lambda: c.url not in urls(server), "c removed")
            print(
                f"\ndiscovery latency: add {added * 1e3:.0f} ms, delete {removed * 1e3:.0f} ms, "
                f"not-ready {unready * 1e3:.0f} ms, relabel {relabel * 1e3:.0f} ms"
            )
            for t in (added, removed, unready, relabel):
                assert t < 1.0
            assert server.registry.workers == []
            # the watch was resumed, never re-listed, and sent the selector to the server
            assert api.list_count() == 1
            assert all(q.get("labelSelector") == "app=sglang" for _, _, q in api.requests)
            assert all(p == f"/api/v1/namespaces/{NS}/pods" for _, p, _ in api.requests)
            metrics = server.metrics.render().decode()
            assert 'fastroute_discovery_workers{role="regular"} 0.0' in metrics
        finally:
            await stop_all(server, api, ws)

    run(body(), 60)


def test_pd_pairs_prefill_and_decode_pods_with_bootstrap_ports(kube_env, caplog):
    async def body():
        api = await KubeApi().start()
        p1, p2, d1, both = ws = await pod_workers(4)
        port = p1.port
        ann = "sglang.ai/bootstrap-port"
        await api.put(pod("p1", p1.ip, labels={"app": "sglang", "component": "prefill"}, annotations={ann: "8998"}))
        await api.put(pod("p2", p2.ip, labels={"app": "sglang", "component": "prefill"}))
        await api.put(pod("d1", d1.ip, labels={"app": "sglang", "component": "decode"}))
        await api.put(pod("both", both.ip, labels={"app": "sglang", "component": "prefill", "tier": "decode"}))
        server = await start(
            api,
            kube_env,
            port,
            selector=[],
            pd_disaggregation=True,
            prefill_selector=["app=sglang", "component=prefill"],
            decode_selector=["app=sglang,tier=decode"],
            decode=[],
            policy="random",
        )
        try:
            await api.put(pod("d2-x", None, labels={"app": "sglang", "tier": "decode"}))
            await until(lambda: urls(server) == {p1.url, p2.url}, 10.0, "prefills")
            # 'both' matches both selectors: not used, logged once; decode side has no usable pod
            await api.put(pod("d1", d1.ip, labels={"app": "sglang", "tier": "decode"}))
            await until(lambda: urls(server) == {p1.url, p2.url, d1.url}, 10.0, "decode")
            roles = {w.url: (w.role, w.bootstrap_port) for w in server.registry.workers}
            assert roles == {p1.url: ("prefill", 8998), p2.url: ("prefill", None), d1.url: ("decode", None)}
            both_lines = [r for r in caplog.records if "matches both" in r.getMessage()]
            assert len(both_lines) == 1
            seen = set()
            for _ in range(12):
                r = await call(server.port, post("/generate", {"text": "hi"}))
                assert r.status == 200
                req = d1.inference()[-1].json
                seen.add((req["bootstrap_host"], req["bootstrap_port"]))
            assert seen == {(p1.ip, 8998), (p2.ip, None)}
            assert both.inference() == []
            m = server.metrics.render().decode()
            assert 'fastroute_discovery_workers{role="prefill"} 2.0' in m
            assert 'fastroute_discovery_workers{role="decode"} 1.0' in m
        finally:
            await stop_all(server, api, ws)

    with caplog.at_level(logging.INFO, logger="fastroute.discovery"):
        run(body(), 60)


@pytest.mark.parametrize("as_event", [False, True], ids=["status-410", "error-event-410"])
def test_stale_watch_relists_without_losing_a_pod(kube_env, as_event):
    async def body():
        api = await KubeApi().start()
        api.gone_as_event = as_event
        a, b = ws = await pod_workers(2)
        await api.put(pod("a", a.ip))
        server = await start(api, kube_env, a.port)
        removed: list[str] = []
        orig = server.registry.remove_worker
        server.registry.remove_worker = lambda w: (removed.append(w.url), orig(w))[1]
        try:
            await until(lambda: urls(server) == {a.url}, 10.0, "a")
            watches = api.watch_count()
            # history compacted while the watch is down; b appears in the gap
            api.compact()
            await api.kick()
            await api.put(pod("b", b.ip))
            await until(lambda: urls(server) == {a.url, b.url}, 10.0, "b after re-list")
            assert api.list_count() == 2 and api.watch_count() > watches
            assert removed == []
            assert server.registry.find(a.url).status == "ready"
        finally:
            await stop_all(server, api, ws)

    run(body(), 60)


def test_api_errors_keep_workers_back_off_and_are_counted(kube_env, caplog, monkeypatch):
    import fastroute.control.kube_watch as kube_watch

    bases: list[float] = []  # the backoff each retry waits on (before its +-20 % jitter)
    real_delay = kube_watch.backoff_delay
    monkeypatch.setattr(kube_watch, "backoff_delay", lambda base, *a: (bases.append(base), real_delay(base, *a))[1])

    async def body():
        api = await KubeApi().start()
        a, b = ws = await pod_workers(2)
        await api.put(pod("a", a.ip))
        server = await start(api, kube_env, a.port)
        try:
            await until(lambda: urls(server) == {a.url}, 10.0, "a")
            api.status = 403
            await api.kick()
            t0 = asyncio.get_running_loop().time()
            del bases[:]
            await until(lambda: sum(1 for t, _, _ in api.requests if t > t0) >= 3, 10.0, "three retries")
            # the wait grows: each failed retry doubles the backoff (jitter aside, which wall-clock
            # gaps on a loaded machine cannot tell apart)
            assert len(bases) >= 2 and all(b2 == 2 * b1 for b1, b2 in zip(bases[:2], bases[1:3])), bases
            assert urls(server) == {a.url}  # workers kept
            m = server.metrics.render().decode()
            assert 'fastroute_discovery_errors_total{provider="kubernetes",reason="403"}' in m
            assert 'fastroute_discovery_workers{role="regular"} 1.0' in m
            msgs = [r.getMessage() for r in caplog.records if "answered 403" in r.getMessage()]
            assert msgs and "get, list and watch on pods" in msgs[0]
            # the API comes back: discovery resumes where it was
            api.status = None
            await api.put(pod("b", b.ip))
            await until(lambda: urls(server) == {a.url, b.url}, 15.0, "b after recovery")
        finally:
            await stop_all(server, api, ws)

    with caplog.at_level(logging.WARNING, logger="fastroute.discovery"):
        run(body(), 60)


def test_discovered_workers_live_beside_command_line_and_admin_ones(kube_env):
    async def body():
        api = await KubeApi().start()
        a, b, c = ws = await pod_workers(3)
        await api.put(pod("a", a.ip))
        await api.put(pod("b", b.ip))
        server = await start(api, kube_env, a.port, worker_urls=[b.url])
        try:
            await until(lambda: urls(server) == {a.url, b.url}, 10.0, "a and b")
            server.registry.add_worker(c.url, "regular")  # as POST /workers does
            await until(lambda: c.url in urls(server), 10.0, "c")
            await api.delete(NS, "b")  # b came from the command line: stays
            await api.delete(NS, "a")
            await until(lambda: urls(server) == {b.url, c.url}, 10.0, "a gone, b and c stay")
        finally:
            await stop_all(server, api, ws)

    run(body(), 60)


def test_file_provider_follows_edits_and_keeps_the_last_good_set(tmp_path, caplog):
    async def body():
        a, b, c = ws = await pod_workers(3)
        path = tmp_path / "workers.json"
        server = Server(
            Config(
                host="127.0.0.1",
                port=0,
                policy="round_robin",
                worker_startup_check_interval=1,
                disable_health_check=True,
                prometheus_host="127.0.0.1",
                prometheus_port=0,
                discovery_provider="file",
                discovery_file=str(path),
            )
        )
        await server.start()
        try:
            path.write_text(json.dumps({"workers": [{"url": a.url}, {"url": b.url, "labels": {"z": "1"}}]}))
            t = await timed(lambda: urls(server) == {a.url, b.url}, "file created")
            path.write_text(json.dumps([{"url": b.url}, {"url": c.url, "worker_type": "regular"}]))
            t2 = await timed(lambda: urls(server) == {b.url, c.url}, "file edited")
            assert t < 1.0 and t2 < 1.0
            r = await call(server.port, post("/generate", {"text": "hi"}))
            assert r.status == 200
            path.write_text('{"workers": [{"url": ')  # malformed
            await until(lambda: any("rejected" in r.getMessage() for r in caplog.records), 5.0, "rejection logged")
            path.write_text(json.dumps([{"url": a.url, "worker_type": "decode"}]))  # wrong mode
            await until(lambda: sum("rejected" in r.getMessage() for r in caplog.records) >= 2, 5.0, "second rejection")
            assert urls(server) == {b.url, c.url}
            m = server.metrics.render().decode()
            assert 'fastroute_discovery_errors_total{provider="file",reason="malformed"} 2.0' in m
            assert 'fastroute_discovery_workers{role="regular"} 2.0' in m
            path.write_text(json.dumps([]))
            await until(lambda: urls(server) == set(), 5.0, "emptied")
        finally:
            await server.stop(grace=0.5)
            for w in ws:
                await w.stop()

    with caplog.at_level(logging.INFO, logger="fastroute.discovery"):
        run(body(), 60)


def test_no_kubernetes_configuration_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config there
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastroute",
            "--service-discovery",
            "--selector",
            "app=sglang",
            "--port",
            "0",
            "--prometheus-port",
            "0",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=str(tmp_path),
    )
    assert proc.returncode == 2
    assert "argument --service-discovery: no Kubernetes configuration found" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_server_refuses_a_hand_built_config_without_kubernetes(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    async def body():
        server = Server(
            Config(
                host="127.0.0.1",
                port=0,
                prometheus_host="127.0.0.1",
                prometheus_port=0,
                service_discovery=True,
                selector=["app=x"],
            )
        )
        with pytest.raises(ConfigError, match="no Kubernetes configuration"):
            await server.start()
        if server.metrics is not None:
            await server.metrics.stop()

    run(body(), 30)


def test_get_workers_shows_where_a_discovered_worker_came_from(kube_env):
    async def body():
        api = await KubeApi().start()
        (a,) = ws = await pod_workers(1)
        await api.put(pod("a", a.ip))
        server = await start(api, kube_env, a.port, service_discovery_namespace=None)
        try:
            await until(lambda: urls(server) == {a.url}, 10.0, "a")
            r = await call(server.port, get("/workers"))
            doc = json.loads(r.body)
            assert doc["workers"][0]["labels"] == {"discovery": "kubernetes", "source": f"{NS}/a"}
            assert all(p == "/api/v1/pods" for _, p, _ in api.requests)  # all namespaces
        finally:
            await stop_all(server, api, ws)

    run(body(), 30)


def test_workers_2_discovers_in_the_supervisor_and_every_process_routes(kube_env, monkeypatch):
    from test_multiproc import MultiRouter, value

    async def body():
        api = await KubeApi().start()
        a, b = ws = await pod_workers(2)
        await api.put(pod("a", a.ip))
        await api.put(pod("b", b.ip))
        kube_env.write_text(api.kubeconfig())
        router = MultiRouter(
            "--service-discovery",
            "--selector",
            "app=sglang",
            "--service-discovery-namespace",
            NS,
            "--service-discovery-port",
            str(a.port),
            "--policy",
            "round_robin",
        )
        try:
            async with router:
                await router.until_metric(
                    lambda m: value(m, "fastroute_discovery_workers", role="regular") == 2,
                    20.0,
                    "two discovered workers",
                )
                for _ in range(12):
                    r = await call(router.port, post("/generate", {"text": "hi"}))
                    assert r.status == 200
                assert a.inference() and b.inference()
                # discovery runs once, in the supervisor: one list, however many processes
                assert api.list_count() == 1
                await api.delete(NS, "a")
                await router.until_metric(
                    lambda m: value(m, "fastroute_discovery_workers", role="regular") == 1, 20.0, "a removed"
                )
                assert await router.stop() == 0
        finally:
            await api.stop()
            for w in ws:
                await w.stop()

    run(body(), 90)


def test_a_pod_that_is_the_router_is_skipped_and_logged_once(kube_env, caplog):
    async def body():
        api = await KubeApi().start()
        a, b = ws = await pod_workers(2)
        # The router listens on 127.0.0.1 at the pods' port: a pod at 127.0.0.1 is the router.
        await api.put(pod("me", "127.0.0.1"))
        await api.put(pod("a", a.ip))
        server = await start(api, kube_env, a.port, port=a.port)
        try:
            await until(lambda: urls(server) == {a.url}, 10.0, "a registered")
            await until(lambda: any("this router" in r.getMessage() for r in caplog.records), 5.0, "refusal logged")
            await api.put(pod("b", b.ip))  # a later change: applied, "me" still out
            await until(lambda: urls(server) == {a.url, b.url}, 10.0, "b registered")
            assert {w.url for w in server.registry.workers} == {a.url, b.url}
        finally:
            await stop_all(server, api, ws)
        assert sum("this router" in r.getMessage() for r in caplog.records) == 1

    with caplog.at_level(logging.INFO, logger="fastroute.discovery"):
        run(body(), 60)
