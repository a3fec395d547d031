"""https:// workers over real sockets: a worker behind a private CA serves through the data path
and is registered, health-checked and load-polled over the same TLS settings; mTLS presents the
client certificate; an untrusted certificate is a clear registration error."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import pytest

pytest.importorskip("cryptography")

from tests.integration.certs import make_ca, make_leaf  # noqa: E402
from tests.integration.conftest import (
    DataWorker,
    Router,
    _WorkerConn,
    call,
    post,  # noqa: E402
    run,
    until,
)


class TLSWorker(DataWorker):
    """DataWorker behind TLS (server certificate from a test CA; optionally requiring mTLS)."""

    def __init__(self, ctx: ssl.SSLContext, **kw: Any) -> None:
        super().__init__(**kw)
        self.ctx = ctx

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def start(self) -> TLSWorker:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _WorkerConn(self), "127.0.0.1", 0, ssl=self.ctx)
        self.port = self._server.sockets[0].getsockname()[1]
        return self


def server_ctx(leaf, client_ca: str | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(leaf.cert, leaf.key)
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=client_ca)
    return ctx


@pytest.fixture
def pki(tmp_path):
    ca, ca_cert, ca_key = make_ca(str(tmp_path))
    server = make_leaf(str(tmp_path), "worker", ca_cert, ca_key)
    client = make_leaf(str(tmp_path), "router", ca_cert, ca_key, server=False)
    return {"ca": ca, "server": server, "client": client, "dir": str(tmp_path)}


def test_https_worker_with_private_ca_serves(pki) -> None:
    async def body() -> None:
        w = await TLSWorker(server_ctx(pki["server"])).start()
        async with Router(worker_urls=[w.url], ca_cert_paths=[pki["ca"].cert]) as r:
            for i in range(3):  # keep-alive reuse of the TLS connection
                res = await call(r.port, post("/generate", {"text": f"hi {i}"}))
                assert res.status == 200 and res.json["text"] == f"hello from {w.name}"
            res = await call(
                r.port, post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "stream": True})
            )
            assert res.status == 200 and res.body.endswith(b"data: [DONE]\n\n")
            assert [rec.path for rec in w.inference()] == ["/generate"] * 3 + ["/v1/chat/completions"]
            # registration went over the same TLS settings
            assert {"/health"} <= {rec.path for rec in w.requests}
            assert r.server.registry.find(w.url).status == "ready"
            await until(lambda: r.in_flight(w) == 0, what="released")

    run(body())


def test_mtls_presents_the_client_certificate(pki) -> None:
    async def body() -> None:
        w = await TLSWorker(server_ctx(pki["server"], client_ca=pki["ca"].cert)).start()
        async with Router(
            worker_urls=[w.url],
            ca_cert_paths=[pki["ca"].cert],
            client_cert_path=pki["client"].cert,
            client_key_path=pki["client"].key,
        ) as r:
            res = await call(r.port, post("/generate", {"text": "hi"}))
            assert res.status == 200

    run(body())


def test_untrusted_certificate_is_a_clear_registration_error(pki) -> None:
    async def body() -> None:
        _, other_cert, other_key = make_ca(pki["dir"], "other CA")
        bad = make_leaf(pki["dir"], "impostor", other_cert, other_key)
        good = await TLSWorker(server_ctx(pki["server"])).start()
        evil = await TLSWorker(server_ctx(bad)).start()
        async with Router(worker_urls=[good.url], ca_cert_paths=[pki["ca"].cert], worker_startup_timeout_secs=30) as r:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            res = await call(
                r.port,
                f"POST /add_worker?url={evil.url} HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n".encode(),
                timeout=20,
            )
            # refused at once (not after the 30 s startup timeout), saying why
            assert loop.time() - t0 < 10
            assert res.status == 400
            assert b"TLS handshake" in res.body and b"certificate" in res.body.lower()
            assert not evil.requests
            assert (await call(r.port, post("/generate", {"text": "hi"}))).status == 200

    run(body())


def test_https_without_ca_is_refused_by_default_verification(pki) -> None:
    """Verification is on by default: without --ca-cert-paths the private CA is not trusted."""

    async def body() -> None:
        plain = await DataWorker().start()
        w = await TLSWorker(server_ctx(pki["server"])).start()
        async with Router(worker_urls=[plain.url]) as r:
            res = await call(
                r.port,
                f"POST /add_worker?url={w.url} HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n".encode(),
                timeout=20,
            )
            assert res.status == 400 and b"TLS handshake" in res.body

    run(body())
