"""Failing closed, over real sockets (what the router cannot do safely it refuses to do): HTTPS on
the listener, control-plane keys with roles, CORS, a probe listener that answers while the proxy
loop is blocked, port clashes and flags that must refuse to start."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.integration.conftest import Router, call, get, post, run, wait_port, workers

cryptography = pytest.importorskip("cryptography")
from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

# ------------------------------------------------------------------------------ certificates


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca_and_cert(tmp: Path, tag: str = "") -> tuple[Path, Path, Path]:
    """A private CA and a server certificate for 127.0.0.1/localhost signed by it."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("fastroute test CA"))
        .issuer_name(_name("fastroute test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, cert_path, key_path = tmp / f"ca{tag}.pem", tmp / f"cert{tag}.pem", tmp / f"key{tag}.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return ca_path, cert_path, key_path


# ------------------------------------------------------------------------------ TLS listener


def test_https_listener_serves_openai_client_json_and_stream(tmp_path: Path) -> None:
    # openai is a test dependency: its absence fails here rather than skipping.  The HTTP client is
    # the one openai builds on (httpx before openai 2, httpx2 since), so the test follows openai.
    import openai

    ca, cert, key = make_ca_and_cert(tmp_path)

    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], tls_cert_path=str(cert), tls_key_path=str(key)) as r:

            def use_client() -> tuple[str, list[str]]:
                http = openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(ca)))
                client = openai.OpenAI(
                    base_url=f"https://127.0.0.1:{r.port}/v1", api_key="x", http_client=http, max_retries=0
                )
                msg = [{"role": "user", "content": "hi"}]
                one = client.chat.completions.create(model="fake-model", messages=msg)
                parts = [
                    c.choices[0].delta.content or ""
                    for c in client.chat.completions.create(model="fake-model", messages=msg, stream=True)
                ]
                http.close()
                return one.choices[0].message.content, parts

            content, parts = await asyncio.to_thread(use_client)
            assert content == f"hi from {w.name}"
            assert "".join(parts).startswith("t0 ")
            # plain HTTP on the HTTPS port is never answered 200
            try:
                res = await call(r.port, get("/health"), timeout=3)
                assert res.status != 200
            except (EOFError, ConnectionError, asyncio.TimeoutError, Exception):
                pass

    run(body())


@pytest.mark.parametrize("which", ["missing-key", "mismatched", "only-cert"])
def test_bad_tls_files_refuse_to_start(tmp_path: Path, which: str) -> None:
    _, cert, key = make_ca_and_cert(tmp_path)
    _, cert2, key2 = make_ca_and_cert(tmp_path, "2")
    argv = {
        "missing-key": ["--tls-cert-path", str(cert), "--tls-key-path", str(tmp_path / "nope.pem")],
        "mismatched": ["--tls-cert-path", str(cert), "--tls-key-path", str(key2)],
        "only-cert": ["--tls-cert-path", str(cert)],
    }[which]
    res = _fastroute(argv + ["--host", "127.0.0.1", "--port", str(_free_port())], timeout=20)
    assert res.returncode != 0
    assert "--tls-" in res.stderr, res.stderr


# ------------------------------------------------------------------------------ control plane keys

ADMIN = "Bearer sk-admin-1"
USER = "Bearer sk-user-1"
KEYS = ["a1:Admin Service:admin:sk-admin-1", "u1:Read Only:user:sk-user-1"]


async def _req(port: int, method: str, path: str, doc=None, auth: str | None = None) -> int:
    data = json.dumps(doc).encode() if doc is not None else b""
    h = f"Authorization: {auth}\r\n" if auth else ""
    raw = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{h}"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data
    return (await call(port, raw)).status


def test_control_plane_roles_on_every_management_route(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="fastroute")

    async def body() -> None:
        (w,) = await workers(1)
        (w2,) = await workers(1)
        async with Router(worker_urls=[w.url], control_plane_api_keys=KEYS, control_plane_audit_enabled=True) as r:
            mutations = [
                ("POST", "/workers", {"url": w2.url}),
                ("POST", f"/add_worker?url={w2.url}", None),
                ("POST", f"/remove_worker?url={w2.url}", None),
                ("DELETE", "/workers/does-not-exist", None),
                ("POST", "/flush_cache", None),
            ]
            for method, path, doc in mutations:
                assert await _req(r.port, method, path, doc) == 401, path
                assert await _req(r.port, method, path, doc, "Bearer wrong") == 401, path
                assert await _req(r.port, method, path, doc, USER) == 403, path
            for path in ("/workers", "/list_workers"):
                assert await _req(r.port, "GET", path) == 401
                assert await _req(r.port, "GET", path, auth=USER) == 200
                assert await _req(r.port, "GET", path, auth=ADMIN) == 200
            assert await _req(r.port, "POST", "/workers", {"url": w2.url}, ADMIN) in (200, 201, 202)
            # probes and inference are not control-plane routes
            assert await _req(r.port, "GET", "/readiness") == 200
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 200

    run(body())
    audit = [rec.getMessage() for rec in caplog.records if "audit" in rec.getMessage()]
    # The audit line's format: control_plane_audit key=<id> role=<role> method=<M> path=<P> ...
    assert any("key=a1" in m and "method=POST path=/workers " in m and "outcome=success" in m for m in audit), audit
    assert any("u1" in m and "denied" in m for m in audit), audit
    assert "sk-admin-1" not in caplog.text


def test_audit_of_put_and_delete_by_worker_id(caplog: pytest.LogCaptureFixture) -> None:
    """PUT and DELETE /workers/{id} under --control-plane-audit-enabled answer 202 and each
    writes one audit line naming the worker's URL (the DELETE's read before it is removed)."""
    caplog.set_level("INFO", logger="fastroute")

    async def body() -> None:
        (w,) = await workers(1)
        (w2,) = await workers(1)
        async with Router(worker_urls=[w.url], control_plane_audit_enabled=True) as r:
            added = await call(r.port, post("/workers", {"url": w2.url}))
            assert added.status == 202, added.body
            wid = added.json["worker_id"]
            put = (
                f"PUT /workers/{wid} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f'Content-Length: 14\r\n\r\n{{"priority":7}}'
            ).encode()
            res = await call(r.port, put)
            assert res.status == 202, res.body
            assert r.server.registry.get(wid).priority == 7
            res = await call(r.port, f"DELETE /workers/{wid} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert res.status == 202, res.body
            assert r.server.registry.get(wid) is None

    run(body())
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "fastroute.audit"]
    for method in ("PUT", "DELETE"):
        mine = [m for m in lines if f"method={method} path=/workers/" in m]
        assert len(mine) == 1, lines
        assert "target=http://127.0.0.1:" in mine[0] and "outcome=success status=202" in mine[0], mine
    assert not [rec for rec in caplog.records if rec.levelname == "ERROR"], caplog.text


def test_without_control_plane_keys_api_key_guards_admin() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        (w2,) = await workers(1)
        async with Router(worker_urls=[w.url], api_key="k1") as r:
            assert await _req(r.port, "POST", "/workers", {"url": w2.url}) == 401
            assert await _req(r.port, "POST", "/workers", {"url": w2.url}, "Bearer k1") in (200, 201, 202)

    run(body())


# ------------------------------------------------------------------------------ probe listener


def test_probe_port_answers_while_proxy_loop_is_blocked() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        probe_port = _free_port()
        async with Router(worker_urls=[w.url], health_check_port=probe_port) as r:
            results: dict[str, float | int] = {}

            def probe() -> None:
                time.sleep(0.3)  # the proxy loop is blocked by then
                for path in ("/health", "/liveness", "/readiness"):
                    t0 = time.monotonic()
                    with urllib.request.urlopen(f"http://127.0.0.1:{probe_port}{path}", timeout=2) as resp:
                        results[path] = resp.status
                    results[path + ":s"] = time.monotonic() - t0

            t = threading.Thread(target=probe)
            t.start()
            time.sleep(2.0)  # block the proxy's event loop on purpose
            await asyncio.to_thread(t.join, 5)
            assert results.get("/health") == 200 and results.get("/liveness") == 200
            assert results.get("/readiness") == 200
            assert max(v for k, v in results.items() if k.endswith(":s")) < 0.1, results
            # and the main port still serves afterwards
            assert (await call(r.port, get("/health"))).status == 200

    run(body())


# ------------------------------------------------------------------------------ CORS


def test_cors_preflight_and_response_headers() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], cors_allowed_origins=["https://app.example.com"]) as r:
            pre = (
                b"OPTIONS /v1/chat/completions HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example.com\r\n"
                b"Access-Control-Request-Method: POST\r\n"
                b"Access-Control-Request-Headers: content-type, authorization\r\n\r\n"
            )
            res = await call(r.port, pre)
            h = res.headers
            assert res.status == 204
            assert h["access-control-allow-origin"] == "https://app.example.com"
            assert "POST" in h["access-control-allow-methods"]
            assert "authorization" in h["access-control-allow-headers"]
            assert "origin" in h.get("vary", "").lower()
            bad = pre.replace(b"https://app.example.com", b"https://evil.example.com")
            res = await call(r.port, bad)
            assert "access-control-allow-origin" not in res.headers
            res = await call(r.port, post("/generate", {"text": "x"}, {"Origin": "https://app.example.com"}))
            assert res.status == 200
            assert res.headers["access-control-allow-origin"] == "https://app.example.com"
            res = await call(r.port, post("/generate", {"text": "x"}, {"Origin": "https://evil.example.com"}))
            assert res.status == 200 and "access-control-allow-origin" not in res.headers

    run(body())


def test_no_cors_by_default() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            res = await call(r.port, post("/generate", {"text": "x"}, {"Origin": "https://app.example.com"}))
            assert res.status == 200 and not any(k.startswith("access-control") for k in res.headers)

    run(body())


# ------------------------------------------------------------------------------ start-up refusals


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _fastroute(argv: list[str], timeout: float = 20, cwd: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("KUBECONFIG", None)
    env.pop("KUBERNETES_SERVICE_HOST", None)
    env["HOME"] = str(Path(cwd or "/tmp") / "no-home")
    return subprocess.run(
        [sys.executable, "-m", "fastroute", *argv], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--jwt-issuer", "https://auth.example.com", "--jwt-audience", "x"], "--jwt-issuer"),
        (["--service-discovery", "--selector", "app=sglang"], "--service-discovery"),
    ],
)
def test_flags_that_would_open_a_door_refuse_to_start(argv: list[str], flag: str, tmp_path: Path) -> None:
    res = _fastroute(argv + ["--port", str(_free_port())], cwd=str(tmp_path))
    assert res.returncode != 0
    assert flag in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_port_clashes_are_one_clear_line() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        for argv in (
            ["--host", "127.0.0.1", "--port", str(port)],
            [
                "--host",
                "127.0.0.1",
                "--port",
                str(_free_port()),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(port),
            ],
            ["--host", "127.0.0.1", "--port", str(_free_port()), "--health-check-port", str(port)],
        ):
            res = _fastroute(argv)
            assert res.returncode == 1, (argv, res.stderr)
            assert "Traceback" not in res.stderr, res.stderr
            assert str(port) in res.stderr and "in use" in res.stderr.lower(), res.stderr
    finally:
        holder.close()


def test_second_single_process_router_on_the_same_port_fails() -> None:
    port = _free_port()
    first = subprocess.Popen(
        [sys.executable, "-m", "fastroute", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_port(port, poll=0.1)
        res = _fastroute(["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", "0"])
        assert res.returncode == 1, res.stderr
        assert "in use" in res.stderr.lower()
    finally:
        first.terminate()
        first.wait(10)


# ------------------------------------------------------------------------------ added with the wiring


def test_https_listener_with_a_stdlib_client_json_and_sse(tmp_path: Path) -> None:
    """The same HTTPS path as the openai test, with nothing but the standard library."""
    ca, cert, key = make_ca_and_cert(tmp_path)

    async def body() -> None:
        (w,) = await workers(1)
        w.events = 3
        async with Router(worker_urls=[w.url], tls_cert_path=str(cert), tls_key_path=str(key)) as r:

            def use() -> tuple[int, bytes, bytes]:
                ctx = ssl.create_default_context(cafile=str(ca))
                req = urllib.request.Request(
                    f"https://127.0.0.1:{r.port}/generate",
                    data=b'{"text": "x"}',
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                    status, one = resp.status, resp.read()
                req = urllib.request.Request(
                    f"https://127.0.0.1:{r.port}/generate",
                    data=b'{"text": "x", "stream": true}',
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
                    stream = resp.read()
                return status, one, stream

            status, one, stream = await asyncio.to_thread(use)
            assert status == 200 and b"hello from" in one
            assert stream.count(b"data: ") >= 3 and stream.rstrip().endswith(b"data: [DONE]")

    run(body())


def test_second_router_under_workers_n_on_a_used_port_fails() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    try:
        res = _fastroute(["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", "0", "--workers", "2"])
        assert res.returncode == 1, res.stderr
        assert "Traceback" not in res.stderr and f"port {port} is already in use" in res.stderr
    finally:
        holder.close()


def test_proxy_processes_never_import_from_the_working_directory(tmp_path: Path) -> None:
    """--workers 2 started from a directory holding a `fastroute/` package: the proxy processes
    must import the installed fastroute, never the planted one."""
    marker = tmp_path / "planted-was-imported"
    planted = tmp_path / "fastroute"
    planted.mkdir()
    (planted / "__init__.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit('planted fastroute imported')\n"
    )
    repo = str(Path(__file__).resolve().parents[2])
    port, mport = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": repo}
    # -P: the test's own command must not import the planted package either.
    proc = subprocess.Popen(
        [
            sys.executable,
            "-P",
            "-m",
            "fastroute",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(mport),
            "--workers",
            "2",
            "--log-level",
            "warning",
        ],
        cwd=str(tmp_path),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 30
        up = 0.0
        while time.time() < deadline and up < 2:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=2) as resp:
                    text = resp.read().decode()
                up = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("fastroute_proxy_process_up")
                )
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        assert not marker.exists(), "a proxy process imported the planted fastroute package"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            assert resp.status == 200
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert not marker.exists()


def test_control_plane_keys_under_workers_n() -> None:
    """A proxy process checks the key before it forwards; the supervisor checks again."""

    async def body() -> None:
        from tests.integration.test_multiproc import MultiRouter

        (w,) = await workers(1)
        (w2,) = await workers(1)
        async with MultiRouter("--worker-urls", w.url, "--control-plane-api-keys", *KEYS) as r:
            assert await _req(r.port, "POST", "/workers", {"url": w2.url}) == 401
            assert await _req(r.port, "POST", "/workers", {"url": w2.url}, USER) == 403
            assert await _req(r.port, "GET", "/workers", auth=USER) == 200
            assert await _req(r.port, "POST", "/workers", {"url": w2.url}, ADMIN) == 202

    run(body(), timeout=60)


def test_log_json_and_smg_aliases_start(tmp_path: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastroute",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            "0",
            "--cache-match-threshold",
            "0.4",
            "--log-json",
            "--bucket-adjust-interval-secs",
            "5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_port(port, poll=0.1)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    docs = [json.loads(line) for line in err.splitlines() if line.strip()]
    assert docs and all({"time", "level", "logger", "message", "pid"} <= d.keys() for d in docs)
    assert any(d["level"] == "WARNING" and d["message"].startswith("--bucket-adjust-interval-secs") for d in docs)
    banner = [d["message"] for d in docs if d["message"].startswith("fastroute ")]
    assert banner and f"http://127.0.0.1:{port}" in banner[0] and "cache_aware" in banner[0]
