"""TLS contexts: the HTTPS listener (``--tls-cert-path/--tls-key-path``) and the client side
towards https:// workers (``--ca-cert-paths``, ``--client-cert-path/--client-key-path``).

Both are built once at start-up; a missing, unreadable or mismatched file is a
:class:`TLSConfigError` whose message names the flag, so the router refuses to start instead of
serving plain HTTP on a port meant for HTTPS.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Sequence


class TLSConfigError(ValueError):
    """A TLS setting cannot be used; the message names the flag."""


def _readable(flag: str, path: str) -> None:
    if not os.path.isfile(path):
        raise TLSConfigError(f"{flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise TLSConfigError(f"{flag} {path}: not readable")


# --tls-min-version: the oldest protocol the listener negotiates. TLS 1.0 and 1.1 are never
# offered (smg refuses them too).
MIN_VERSIONS: dict[str, ssl.TLSVersion] = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


def server_context(cert_path: str | None, key_path: str | None, min_version: str = "1.2") -> ssl.SSLContext | None:
    """The listener's context, or None when neither flag is given (plain HTTP)."""
    if min_version not in MIN_VERSIONS:
        raise TLSConfigError(f"--tls-min-version {min_version!r}: choose from " + ", ".join(MIN_VERSIONS))
    if not cert_path and not key_path:
        return None
    if not cert_path or not key_path:
        missing = "--tls-cert-path" if not cert_path else "--tls-key-path"
        raise TLSConfigError(f"{missing} is required with {'--tls-key-path' if not cert_path else '--tls-cert-path'}")
    _readable("--tls-cert-path", cert_path)
    _readable("--tls-key-path", key_path)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = MIN_VERSIONS[min_version]
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        ctx.load_cert_chain(cert_path, key_path)
    except ssl.SSLError as exc:
        raise TLSConfigError(
            f"--tls-cert-path {cert_path} / --tls-key-path {key_path}: cannot be used together ({exc.reason or exc})"
        ) from None
    except OSError as exc:
        raise TLSConfigError(f"--tls-cert-path/--tls-key-path: {exc}") from None
    return ctx


def client_context(
    ca_paths: Sequence[str] = (), cert_path: str | None = None, key_path: str | None = None
) -> ssl.SSLContext:
    """The context used for https:// workers: verifies by default (system CAs plus
    ``ca_paths``), presents a client certificate for mTLS when given."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.set_alpn_protocols(["http/1.1"])
    for path in ca_paths:
        _readable("--ca-cert-paths", path)
        try:
            ctx.load_verify_locations(cafile=path)
        except ssl.SSLError as exc:
            raise TLSConfigError(f"--ca-cert-paths {path}: not a PEM CA certificate ({exc.reason or exc})") from None
    if bool(cert_path) != bool(key_path):
        raise TLSConfigError("--client-cert-path and --client-key-path go together")
    if cert_path and key_path:
        _readable("--client-cert-path", cert_path)
        _readable("--client-key-path", key_path)
        try:
            ctx.load_cert_chain(cert_path, key_path)
        except ssl.SSLError as exc:
            raise TLSConfigError(
                f"--client-cert-path {cert_path} / --client-key-path {key_path}: "
                f"cannot be used together ({exc.reason or exc})"
            ) from None
    return ctx


def worker_context(
    ca_paths: Sequence[str] = (), cert_path: str | None = None, key_path: str | None = None, urls: Sequence[str] = ()
) -> ssl.SSLContext | None:
    """The client context when anything asks for TLS to workers (a TLS flag, or an https:// URL
    among ``urls``), built at start-up so a bad file stops the router; else None (a worker added
    later over https gets the system default then)."""
    if ca_paths or cert_path or key_path or any(u.startswith("https://") for u in urls):
        return client_context(ca_paths, cert_path, key_path)
    return None
