"""Router errors and their wire encodings.

Owns the one table that maps failures to HTTP status and smg error codes
(protocol.md 3.7 and 6.9), the smg JSON error body, and the SSE error event sent
when a streaming request fails.  Everything here returns ready-to-send bytes so
the proxy never builds error JSON itself.

Shapes produced:

* JSON body (smg shape, also used for sglang-router compatible clients, which
  only read ``error.message`` / ``error.code``)::

      {"error":{"type":"invalid_request_error","code":"...","message":"...","param":null}}

  ``type`` is ``invalid_request_error`` for 4xx and ``server_error`` otherwise.
  The proxy also sends the code as the ``x-smg-error-code`` response header.
* SSE error (streaming request whose upstream failed; a complete event, then
  ``[DONE]``, never truncated to an upstream content-length)::

      data: {"error": {"message": "...", "status": 503}}\\n\\ndata: [DONE]\\n\\n
"""

from __future__ import annotations

import json

__all__ = [
    "RouterError",
    "error_response",
    "error_type",
    "leg_error_code",
    "leg_error",
    "sse_error",
    "unknown_url",
    "no_available_workers",
    "payload_too_large",
    "queue_full",
    "queue_timeout",
    "invalid_api_key",
    "bad_gateway",
    "gateway_timeout",
    "CODE_BAD_REQUEST",
    "CODE_NO_AVAILABLE_WORKERS",
    "CODE_UNKNOWN_URL",
    "CODE_MODEL_NOT_FOUND",
    "CODE_PAYLOAD_TOO_LARGE",
    "CODE_QUEUE_FULL",
    "CODE_QUEUE_TIMEOUT",
    "CODE_INVALID_API_KEY",
    "CODE_BAD_GATEWAY",
    "CODE_GATEWAY_TIMEOUT",
]

CODE_BAD_REQUEST = "bad_request"
CODE_NO_AVAILABLE_WORKERS = "no_available_workers"
CODE_UNKNOWN_URL = "unknown_url"
CODE_MODEL_NOT_FOUND = "model_not_found"
CODE_PAYLOAD_TOO_LARGE = "payload_too_large"
CODE_QUEUE_FULL = "queue_full"
CODE_QUEUE_TIMEOUT = "queue_timeout"
CODE_INVALID_API_KEY = "invalid_api_key"
CODE_BAD_GATEWAY = "bad_gateway"
CODE_GATEWAY_TIMEOUT = "gateway_timeout"

# Upstream status -> code suffix for a failed PD leg (protocol.md 3.7).  Any
# status not in this table is reported as 500 "<leg>_error".
_LEG_SUFFIX = {
    400: "bad_request",
    404: "not_found",
    500: "internal_error",
    502: "bad_gateway",
    503: "unavailable",
}
# Pre-built (status, code) answers: leg_error_code runs on every failed attempt,
# so the strings are formatted once at import.
_LEG_CODES = {
    leg: {status: (status, f"{leg}_{suffix}") for status, suffix in _LEG_SUFFIX.items()}
    for leg in ("prefill", "decode")
}
_LEG_OTHER = {leg: (500, f"{leg}_error") for leg in ("prefill", "decode")}

# Upstream error bodies are embedded in our messages; a misbehaving worker can
# return megabytes, so the copy is bounded.
_MAX_EMBEDDED_BODY = 4096


def error_type(status: int) -> str:
    """smg's ``error.type``: client errors vs everything else."""
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class RouterError(Exception):
    """A request failure with a known HTTP answer.

    ``headers`` are extra response headers as (name, value) byte pairs, e.g.
    ``WWW-Authenticate`` for 401.  The proxy adds ``x-smg-error-code`` itself.
    """

    __slots__ = ("status", "code", "message", "headers")

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        super().__init__(status, code, message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers

    def body(self) -> bytes:
        """The smg JSON error body for this error."""
        return error_response(self.status, self.code, self.message)

    def sse(self) -> bytes:
        """The SSE error event + ``[DONE]`` for this error (streaming requests)."""
        return sse_error(self.message, self.status)

    def __str__(self) -> str:
        return f"{self.status} {self.code}: {self.message}"

    def __repr__(self) -> str:
        return f"RouterError({self.status!r}, {self.code!r}, {self.message!r})"


def error_response(status: int, code: str, message: str) -> bytes:
    """smg-shaped JSON error body: ``{"error":{"type","code","message","param":null}}``."""
    # json.dumps escapes quotes/control characters in the message; ensure_ascii
    # keeps the body pure ASCII whatever an upstream put in its error text.
    if type(message) is not str:
        message = str(message)
    return (
        b'{"error":{"type":"'
        + error_type(status).encode()
        + b'","code":'
        + json.dumps(code).encode()
        + b',"message":'
        + json.dumps(message).encode()
        + b',"param":null}}'
    )


def sse_error(message: str, status: int) -> bytes:
    """A complete SSE error event followed by the ``[DONE]`` terminator."""
    if type(message) is not str:
        message = str(message)
    return (
        b'data: {"error": {"message": '
        + json.dumps(message).encode()
        + b', "status": '
        + str(int(status)).encode()
        + b"}}\n\ndata: [DONE]\n\n"
    )


def leg_error_code(leg: str, status: int) -> tuple[int, str]:
    """Map a failed PD leg's upstream status to (status sent to client, code).

    ``leg`` is "prefill" or "decode".  400/404/500/502/503 keep their status;
    anything else becomes 500 with code ``<leg>_error``.
    """
    try:
        codes = _LEG_CODES[leg]
    except KeyError:
        raise ValueError(f"leg must be 'prefill' or 'decode', not {leg!r}") from None
    found = codes.get(status)
    return found if found is not None else _LEG_OTHER[leg]


def _upstream_message(body: bytes) -> str:
    """The error text of a worker's error body.

    SGLang answers errors as ``{"error": {"message": ...}}`` (OpenAI paths),
    ``{"error": "..."}``, ``{"message": ...}`` or ``{"detail": ...}`` (FastAPI);
    anything else is used as text.
    """
    if len(body) > _MAX_EMBEDDED_BODY:
        body = body[:_MAX_EMBEDDED_BODY]
        return body.decode("utf-8", "replace")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return body.decode("utf-8", "replace")
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if isinstance(obj.get(key), str):
                return obj[key]
    return body.decode("utf-8", "replace")


def leg_error(leg: str, status: int, body: bytes) -> RouterError:
    """The client-facing error for a PD leg that answered non-2xx.

    Decode: the message is the decode's own error message.  Prefill: the
    message embeds the prefill body (bounded to 4 KiB), as smg does.
    """
    status_out, code = leg_error_code(leg, status)
    if leg == "decode":
        message = _upstream_message(body)
    else:
        text = body[:_MAX_EMBEDDED_BODY].decode("utf-8", "replace")
        message = f"Prefill server error ({status}): {text}"
    return RouterError(status_out, code, message)


def unknown_url(method: str, path: str) -> RouterError:
    """404 for a path the router does not serve (protocol.md 6.9)."""
    return RouterError(404, CODE_UNKNOWN_URL, f"Invalid URL ({method} {path})")


def no_available_workers(role: str | None = None) -> RouterError:
    """503 when no healthy, circuit-closed target exists for a leg."""
    what = f"{role} workers" if role else "workers"
    return RouterError(
        503, CODE_NO_AVAILABLE_WORKERS, f"No available {what} (all unhealthy, circuits open or none registered)"
    )


def payload_too_large(size: int, limit: int) -> RouterError:
    return RouterError(413, CODE_PAYLOAD_TOO_LARGE, f"Request body of {size} bytes exceeds the limit of {limit} bytes")


def internal_error(message: str = "internal error") -> RouterError:
    """A bug or an unexpected failure inside the router (logged where it happened)."""
    return RouterError(500, "internal_error", message)


def queue_full() -> RouterError:
    # Retry-After: clients (and the openai library) back off instead of hammering a full queue.
    return RouterError(
        429, CODE_QUEUE_FULL, "Too many requests: admission queue is full", headers=((b"Retry-After", b"1"),)
    )


def queue_timeout() -> RouterError:
    return RouterError(408, CODE_QUEUE_TIMEOUT, "Request timed out waiting in the admission queue")


def invalid_api_key() -> RouterError:
    return RouterError(
        401,
        CODE_INVALID_API_KEY,
        "Invalid or missing API key",
        ((b"WWW-Authenticate", b'Bearer realm="data-plane"'),),
    )


def insufficient_role(role: str) -> RouterError:
    """403 for a control-plane key whose role may not make this change (smg's roles)."""
    return RouterError(403, "forbidden", f"Role {role!r} may not change workers; an admin key is required")


def admin_closed() -> RouterError:
    """403 for a worker-management route of a process that keeps them closed (fastroute sidecar
    without keys)."""
    return RouterError(
        403,
        "admin_api_closed",
        "The worker-management routes are closed here: give --api-key or --control-plane-api-keys, "
        "or pass --allow-open-admin to open them",
    )


def bad_gateway(message: str = "PD disaggregation request failed") -> RouterError:
    """502: an upstream failed at the transport level before the first byte."""
    return RouterError(502, CODE_BAD_GATEWAY, message)


def gateway_timeout(message: str = "Upstream request timed out") -> RouterError:
    return RouterError(504, CODE_GATEWAY_TIMEOUT, message)
