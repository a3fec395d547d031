"""Over real sockets: the HTTPS listener's oldest TLS version (1.2, or 1.3 with
--tls-min-version), smg's auth scope on /get_loads and the shared reads, and the WARNING a worker
that requires a client certificate gets on its first refusal."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import warnings

import pytest

pytest.importorskip("cryptography")

from tests.integration.certs import make_ca, make_leaf  # noqa: E402
from tests.integration.conftest import DataWorker, Router, call, run, until  # noqa: E402
from tests.integration.test_tls_workers import TLSWorker, server_ctx  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    OLD = (ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1)


@pytest.fixture
def pki(tmp_path):
    ca, ca_cert, ca_key = make_ca(str(tmp_path))
    return {"ca": ca, "server": make_leaf(str(tmp_path), "router", ca_cert, ca_key)}


def _client(ca: str, lo: ssl.TLSVersion, hi: ssl.TLSVersion) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version, ctx.maximum_version = lo, hi
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # let the client offer TLS 1.0/1.1 at all
    return ctx


def _handshake(port: int, ctx: ssl.SSLContext) -> str | None:
    """The negotiated version, or None when the server refused the handshake."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        try:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                return tls.version()
        except (ssl.SSLError, ConnectionError):
            return None


def _permissive_server(pki) -> tuple[int, threading.Thread]:
    """A plain TLS server that allows TLS 1.0+: proves the old-version client can connect."""
    srv = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        srv.minimum_version = ssl.TLSVersion.TLSv1
    srv.set_ciphers("DEFAULT:@SECLEVEL=0")
    srv.load_cert_chain(pki["server"].cert, pki["server"].key)
    lsock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = lsock.accept()
        try:
            srv.wrap_socket(conn, server_side=True).close()
        except (ssl.SSLError, OSError):
            conn.close()
        lsock.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return lsock.getsockname()[1], t


def test_listener_tls_floor_is_1_2_or_the_flags(pki) -> None:
    """TLS 1.0/1.1 are refused by default (a permissive control server proves the client really
    speaks 1.1), and --tls-min-version 1.3 refuses 1.2 too."""
    ca = pki["ca"].cert
    port, t = _permissive_server(pki)
    assert _handshake(port, _client(ca, *OLD)) == "TLSv1.1"
    t.join(5)
    only12 = (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_2)

    async def body() -> None:
        (w,) = [await DataWorker().start()]
        tls = {"tls_cert_path": pki["server"].cert, "tls_key_path": pki["server"].key}
        async with Router(worker_urls=[w.url], **tls) as r:
            assert await asyncio.to_thread(_handshake, r.port, _client(ca, *OLD)) is None
            assert await asyncio.to_thread(_handshake, r.port, _client(ca, *only12)) == "TLSv1.2"
        async with Router(worker_urls=[w.url], tls_min_version="1.3", **tls) as r:
            assert await asyncio.to_thread(_handshake, r.port, _client(ca, *only12)) is None
            v13 = await asyncio.to_thread(
                _handshake, r.port, _client(ca, ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3)
            )
            assert v13 == "TLSv1.3"

    run(body())


def test_tls_min_version_flag_values(capsys) -> None:
    from fastroute.config.cli import parse_args

    assert parse_args(["--tls-min-version", "1.3"]).tls_min_version == "1.3"
    assert parse_args([]).tls_min_version == "1.2"
    for bad in ("1.1", "1.0"):
        with pytest.raises(SystemExit):
            parse_args(["--tls-min-version", bad])
        assert "--tls-min-version" in capsys.readouterr().err


# ------------------------------------------------------------------------------ auth scope

ADMIN, USER, DATA = "Bearer sk-admin-1", "Bearer sk-user-1", "Bearer data-key"
KEYS = ["a1:Admin:admin:sk-admin-1", "u1:Reader:user:sk-user-1"]


async def _status(port: int, path: str, auth: str | None = None) -> int:
    h = f"Authorization: {auth}\r\n" if auth else ""
    return (await call(port, f"GET {path} HTTP/1.1\r\nHost: x\r\n{h}\r\n".encode())).status


def test_get_loads_needs_a_control_plane_key_when_only_those_are_configured() -> None:
    async def body() -> None:
        (w,) = [await DataWorker().start()]
        async with Router(worker_urls=[w.url], control_plane_api_keys=KEYS) as r:
            assert await _status(r.port, "/get_loads") == 401
            assert await _status(r.port, "/get_loads", "Bearer wrong") == 401
            assert await _status(r.port, "/get_loads", USER) == 200
            assert await _status(r.port, "/get_loads", ADMIN) == 200
            # smg serves these publicly: still open with control-plane keys alone
            assert await _status(r.port, "/get_server_info") == 200

    run(body())


@pytest.mark.parametrize("path", ["/get_server_info", "/engine_metrics", "/get_model_info"])
def test_shared_reads_take_the_data_key_or_any_control_plane_key(path: str) -> None:
    async def body() -> None:
        (w,) = [await DataWorker().start()]
        async with Router(worker_urls=[w.url], api_key="data-key", control_plane_api_keys=KEYS) as r:
            assert await _status(r.port, path) == 401
            assert await _status(r.port, path, "Bearer wrong") == 401
            for auth in (DATA, ADMIN, USER):  # let in (the answer itself is the route's)
                assert await _status(r.port, path, auth) not in (401, 403), auth

    run(body())


def test_get_loads_with_both_layers_takes_control_plane_keys() -> None:
    async def body() -> None:
        (w,) = [await DataWorker().start()]
        async with Router(worker_urls=[w.url], api_key="data-key", control_plane_api_keys=KEYS) as r:
            assert await _status(r.port, "/get_loads") == 401
            assert await _status(r.port, "/get_loads", ADMIN) == 200
            assert await _status(r.port, "/get_loads", USER) == 200
            # control-plane keys replace --api-key on smg's admin routes
            assert await _status(r.port, "/get_loads", DATA) == 401
            # /health_generate (a generation on a worker) takes any of the three keys
            assert await _status(r.port, "/health_generate") == 401
            for auth in (DATA, ADMIN, USER):
                assert await _status(r.port, "/health_generate", auth) not in (401, 403), auth

    run(body())


# ------------------------------------------------------------------------------ mTLS refusal


def test_worker_requiring_a_client_certificate_warns_on_the_first_refusal(tmp_path, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="fastroute")
    ca, ca_cert, ca_key = make_ca(str(tmp_path))
    leaf = make_leaf(str(tmp_path), "worker", ca_cert, ca_key)

    async def body() -> None:
        plain = await DataWorker().start()
        w = await TLSWorker(server_ctx(leaf, client_ca=ca.cert)).start()
        async with Router(
            worker_urls=[plain.url],
            ca_cert_paths=[ca.cert],
            worker_startup_timeout_secs=60,
            worker_startup_check_interval=1,
        ) as r:
            add = "POST /workers HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            doc = '{"url": "%s"}' % w.url
            res = await call(r.port, (add + f"Content-Length: {len(doc)}\r\n\r\n{doc}").encode())
            assert res.status == 202

            def warned() -> list[logging.LogRecord]:
                return [
                    x
                    for x in caplog.records
                    if x.levelno == logging.WARNING
                    and w.url in x.getMessage()
                    and "client certificate" in x.getMessage()
                ]

            await until(lambda: warned(), 20, "a WARNING naming the refusal")
            # retried (DEBUG) but warned once
            await until(
                lambda: len([x for x in caplog.records if w.url in x.getMessage() and x.levelno == logging.DEBUG]) >= 2,
                20,
                "a retry",
            )
            assert len(warned()) == 1
            assert "--client-cert-path" in warned()[0].getMessage()
            assert r.server.registry.find(w.url).status == "pending"

    run(body(), timeout=60)
