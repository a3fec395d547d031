"""One parsed client request: what the client protocol read of a request's head and body, and
what the dispatcher, the routes and the exchanges read back.

A module of its own so that every compiled reader can type it (C field reads instead of
attribute lookups): protocol.py, which makes requests, cimports the dispatcher, so the
dispatcher could not cimport it from there.
"""

from __future__ import annotations


class Request:
    """One parsed client request (kept only until it is answered)."""

    __slots__ = (
        "method",
        "url",
        "fwd",
        "auth",
        "rid",
        "key",
        "body",
        "body_len",
        "too_large",
        "keep_alive",
        "http11",
        "origin",
        "acrh",
        "__weakref__",
    )

    def __init__(self) -> None:
        self.method = b"GET"
        self.url = b"/"
        self.fwd = b""
        self.auth: bytes | None = None
        self.rid: bytes | None = None
        self.key: bytes | None = None
        self.body = b""
        self.body_len = 0
        self.too_large = False
        self.keep_alive = True
        self.http11 = True
        self.origin: bytes | None = None  # set only when CORS is configured
        self.acrh: bytes | None = None
