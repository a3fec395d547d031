"""Kubernetes discovery against hostile or broken API answers: watch lines of the
wrong shape, a crash inside the watch, 410 Gone on every watch, a watch that hangs without a
byte, and a burst of 1,500 pods. Same stand-ins as test_discovery.py: the Kubernetes API
stand-in (tests/integration/kubeapi.py) and fake workers on loopback addresses."""

from __future__ import annotations

import asyncio
import json
import logging

from conftest import call, get, run, until
from kubeapi import KubeApi, pod
from test_discovery import (
    NS,
    PodWorker,
    kube_env,  # noqa: F401 (the fixture)
    pod_workers,
    start,
    stop_all,
    urls,
)

from fastroute.config import Config
from fastroute.control import discovery
from fastroute.dataplane import upstreams as upstreams_module
from fastroute.runtime.server import Server

TASK = "discovery regular pods"

# Valid JSON, wrong shape: each of these once ended the watch task for good, so discovery stopped.
BAD_LINES = [
    b"null",
    b"[1,2]",
    b'"ADDED"',
    b"17",
    b'{"type": "ADDED"}',
    b'{"type": "ADDED", "object": null}',
    b'{"type": "ADDED", "object": [1]}',
    b'{"type": ["ADDED"], "object": {}}',
    b'{"type": "ADDED", "object": {"metadata": "pod-x"}}',
    b'{"type": "ADDED", "object": {"metadata": {"name": "x", "namespace": "team-a", "labels": ["app", "sglang"]}}}',
    b'{"type": "ADDED", "object": {"metadata": {"name": 5, "namespace": "team-a"}}}',
    b'{"type": "MODIFIED", "object": {"metadata": {"name": "x", "namespace": "team-a", '
    b'"labels": {"app": "sglang"}}, "status": {"phase": "Running", "podIP": 167772165}}}',
    b'{"type": "MODIFIED", "object": {"metadata": {"name": "x", "namespace": "team-a", '
    b'"labels": {"app": "sglang"}}, "status": {"phase": "Running", "podIP": "127.0.0.9", '
    b'"conditions": "Ready"}}}',
    b'{"type": "MODIFIED", "object": {"metadata": {"name": "x", "namespace": "team-a", '
    b'"labels": {"app": "sglang"}, "annotations": {"b": 1}}, "status": "Running"}}',
    b'{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": 7}}}',
    b"[" * 100000,
    b"not json at all",
]


def metric(server, name: str) -> float:
    for line in server.metrics.render().decode().splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_watch_lines_of_the_wrong_shape_are_skipped_counted_and_the_watch_goes_on(kube_env, caplog):
    async def body():
        api = await KubeApi().start()
        a, b, c = ws = await pod_workers(3)
        await api.put(pod("a", a.ip))
        server = await start(api, kube_env, a.port)
        try:
            await until(lambda: urls(server) == {a.url}, 10.0, "a")
            watches = api.watch_count()
            for line in BAD_LINES:
                await api.inject(line)
            await api.put(pod("b", b.ip))
            await until(lambda: urls(server) == {a.url, b.url}, 10.0, "b after the bad lines")
            await api.delete(NS, "a")
            await until(lambda: urls(server) == {b.url}, 10.0, "a removed after the bad lines")
            # a bad listed pod is skipped too, the others of the list are used
            api.compact()
            api.pods[(NS, "junk")] = {
                "metadata": {"name": "junk", "namespace": NS, "labels": {"app": "sglang"}},
                "status": [1],
            }
            await api.kick()
            await api.put(pod("c", c.ip))
            await until(lambda: urls(server) == {b.url, c.url}, 10.0, "c after the re-list")
            # every line was skipped without ending the watch task
            st = server.registry.background.tasks[TASK]
            assert st.restarts == 0
            m = server.metrics.render().decode()
            skipped = metric(server, 'fastroute_discovery_errors_total{provider="kubernetes",reason="bad_object"}')
            assert skipped >= len(BAD_LINES) + 1, m
            assert api.watch_count() > watches
            warned = [r for r in caplog.records if "skipped a" in r.getMessage()]
            assert 1 <= len(warned) <= 3  # once per watch episode, not once per line
            assert 'fastroute_background_task_up{task="discovery regular pods"} 1.0' in m
        finally:
            await stop_all(server, api, ws)

    with caplog.at_level(logging.INFO, logger="fastroute"):
        run(body(), 60)


def test_a_crash_inside_the_watch_restarts_the_task_counted_and_logged_once(kube_env, caplog, monkeypatch):
    """Whatever still kills the watch loop (here: a bug on one pod) restarts it."""

    async def body():
        api = await KubeApi().start()
        a, b = ws = await pod_workers(2)
        await api.put(pod("a", a.ip))
        server = await start(api, kube_env, a.port)
        real = discovery.pod_worker
        crashes = []

        def buggy(p, *args):
            if p["metadata"]["name"] == "boom" and len(crashes) < 4:
                crashes.append(1)
                raise KeyError("a bug")
            return real(p, *args)

        monkeypatch.setattr(discovery, "pod_worker", buggy)
        try:
            await until(lambda: urls(server) == {a.url}, 10.0, "a")
            await api.put(pod("boom", "127.0.0.99"))
            st = server.registry.background.tasks[TASK]
            await until(lambda: st.restarts >= 1, 10.0, "a restart")
            r = await call(server.port, get("/readiness"))
            # the task came back: new pods are followed again
            await api.put(pod("b", b.ip))
            await until(lambda: b.url in urls(server), 15.0, "b after the crashes")
            assert len(crashes) == 4 and st.restarts >= 3
            m = server.metrics.render().decode()
            assert metric(server, f'fastroute_background_errors_total{{task="{TASK}"}}') >= 4
            assert f'fastroute_background_task_up{{task="{TASK}"}} 1.0' in m
            errors = [x for x in caplog.records if x.levelno >= logging.ERROR and TASK in x.getMessage()]
            assert len(errors) == 1 and "KeyError" in errors[0].getMessage()
            assert "Traceback" not in caplog.text
            assert r.status == 200  # workers stay routable; the stale view is named
            assert TASK in json.loads(r.body).get("stale", [])
        finally:
            await stop_all(server, api, ws)

    with caplog.at_level(logging.INFO, logger="fastroute"):
        run(body(), 60)


def test_file_manifests_that_killed_the_follower_are_rejected_and_it_goes_on(tmp_path, caplog):
    async def body():
        a, b = ws = await pod_workers(2)
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
            path.write_text(json.dumps([{"url": a.url}]))
            await until(lambda: urls(server) == {a.url}, 5.0, "a")
            for bad in (
                "[" * 100000,
                json.dumps([{"url": b.url, "worker_type": {"x": 1}}]),
                json.dumps([{"url": b.url, "bootstrap_port": [1]}]),
            ):
                n = server.registry.background.tasks["discovery file"].errors
                path.write_text(bad)
                await until(lambda: server.registry.background.tasks["discovery file"].errors > n, 5.0, "rejected")
                assert server.registry.background.stale() == ["discovery file"]
            path.write_text(json.dumps([{"url": a.url}, {"url": b.url}]))
            await until(lambda: urls(server) == {a.url, b.url}, 5.0, "b after the bad files")
            assert server.registry.background.tasks["discovery file"].up
            assert server.registry.background.stale() == []
        finally:
            await server.stop(grace=0.5)
            for w in ws:
                await w.stop()

    with caplog.at_level(logging.INFO, logger="fastroute.discovery"):
        run(body(), 60)


def test_410_on_every_watch_backs_off_and_logs_once(kube_env, caplog):
    async def body():
        api = await KubeApi().start()
        (a,) = ws = await pod_workers(1)
        await api.put(pod("a", a.ip))
        server = await start(api, kube_env, a.port)
        try:
            await until(lambda: urls(server) == {a.url}, 10.0, "a")
            api.floor = 10**9  # every watch is too old: an API that 410s forever
            await api.kick()
            t0 = asyncio.get_running_loop().time()
            await until(
                lambda: sum(1 for t, _, q in api.requests if t > t0 and q.get("watch") != "true") >= 4,
                20.0,
                "four re-lists",
            )
            lists = [t for t, _, q in api.requests if t > t0 and q.get("watch") != "true"]
            gaps = [y - x for x, y in zip(lists, lists[1:])]
            assert gaps[2] > gaps[0] * 1.5  # the wait grows (jitter is +-20 %)
            assert len(api.requests) < 40  # not hundreds of requests a second
            # "410 Gone", not "410": a worker's URL can hold 410 in its port (e.g. :41012).
            gone = [r for r in caplog.records if r.name == "fastroute.discovery" and "410 Gone" in r.getMessage()]
            assert len(gone) == 1
            assert urls(server) == {a.url}
            # success resets it: a healthy API is followed at once again
            api.floor = 0
            b = await PodWorker("127.0.0.3", a.port).start()
            ws.append(b)
            await api.put(pod("b", b.ip))
            await until(lambda: b.url in urls(server), 20.0, "b after the 410s")
        finally:
            await stop_all(server, api, ws)

    with caplog.at_level(logging.INFO, logger="fastroute.discovery"):
        run(body(), 60)


def test_a_watch_that_hangs_without_bytes_is_restarted(kube_env):
    async def body():
        api = await KubeApi().start()
        a, b = ws = await pod_workers(2)
        await api.put(pod("a", a.ip))
        api.hang = True
        # the server's timeoutSeconds is 1 s; a watch silent past it + the grace is given up
        server = await start(api, kube_env, a.port, discovery_check_interval_secs=1)
        try:
            await until(lambda: urls(server) == {a.url}, 10.0, "a from the list")
            await until(lambda: api.watch_count() >= 1, 5.0, "a watch")
            api.hang = False  # the next watch works; the hung one never will
            await api.put(pod("b", b.ip))
            await until(lambda: b.url in urls(server), 15.0, "b through a new watch")
            assert api.watch_count() >= 2 and api.list_count() == 1
            assert metric(server, 'fastroute_discovery_errors_total{provider="kubernetes",reason="watch_idle"}') >= 1
        finally:
            await stop_all(server, api, ws)

    run(body(), 60)


def test_a_burst_of_pods_is_linear_and_never_stalls_the_loop(kube_env, monkeypatch):
    """1,000 pods listed (700 Ready) and 500 watch events (300 turn Ready, 200 new ones not
    yet): each event is one pod's work (counted), and the loop keeps serving meanwhile (lag
    bound generous: /health took 17.8 s before). 1,000 workers: the table holds 1,024."""

    async def body():
        api = await KubeApi().start()
        w = await PodWorker("0.0.0.0").start()  # answers on every 127.x.y.z address
        ip = lambda i: f"127.1.{i // 250}.{i % 250 + 1}"  # noqa: E731
        for i in range(1000):
            api.pods[(NS, f"p{i}")] = pod(f"p{i}", ip(i), ready=i < 700)
        calls = []
        real = discovery.pod_worker
        monkeypatch.setattr(discovery, "pod_worker", lambda *a: (calls.append(1), real(*a))[1])
        builds = []
        real_route = upstreams_module.Route
        monkeypatch.setattr(upstreams_module, "Route", lambda *a: (builds.append(1), real_route(*a))[1])
        lag = [0.0]
        loop = asyncio.get_running_loop()

        async def probe():
            while True:
                t = loop.time()
                await asyncio.sleep(0.005)
                lag[0] = max(lag[0], loop.time() - t - 0.005)

        server = await start(api, kube_env, w.port, disable_load_monitoring=True)
        ticker = loop.create_task(probe())
        try:
            await until(lambda: len(server.registry.workers) == 700, 20.0, "the list")
            for i in range(700, 1000):
                await api.put(pod(f"p{i}", ip(i)))
            for i in range(1000, 1200):
                await api.put(pod(f"p{i}", ip(i), ready=False))
            await until(lambda: len(urls(server)) == 1000, 60.0, "every Ready pod registered")
            r = await call(server.port, get("/health"))
            assert r.status == 200
            assert len(calls) <= 2 * 1500  # O(1) per event, not a recount per event
            assert len(builds) <= 2 * 1000  # a route per worker, not all per activation
            assert lag[0] < 0.5, lag[0]
        finally:
            ticker.cancel()
            await server.stop(grace=0.5)
            await api.stop()
            await w.stop()

    run(body(), 120)
