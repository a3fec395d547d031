"""Error shapes and the per-leg status/code table (protocol.md 3.7, 6.9)."""

from __future__ import annotations

import json

import pytest

from fastroute import errors
from fastroute.errors import RouterError, error_response, leg_error, leg_error_code, sse_error


def test_error_response_smg_shape() -> None:
    body = error_response(503, "no_available_workers", "nothing healthy")
    assert json.loads(body) == {
        "error": {
            "type": "server_error",
            "code": "no_available_workers",
            "message": "nothing healthy",
            "param": None,
        }
    }


def test_error_type_by_status_class() -> None:
    assert json.loads(error_response(400, "bad_request", "x"))["error"]["type"] == "invalid_request_error"
    assert json.loads(error_response(404, "unknown_url", "x"))["error"]["type"] == "invalid_request_error"
    assert json.loads(error_response(502, "bad_gateway", "x"))["error"]["type"] == "server_error"


def test_error_response_escapes_message() -> None:
    msg = 'quote " backslash \\ newline \n unicode \u00e9\u4e2d control \x01'
    body = error_response(500, "decode_internal_error", msg)
    assert body.isascii()
    assert json.loads(body)["error"]["message"] == msg


@pytest.mark.parametrize(
    "status,expected",
    [
        (400, (400, "bad_request")),
        (404, (404, "not_found")),
        (500, (500, "internal_error")),
        (502, (502, "bad_gateway")),
        (503, (503, "unavailable")),
        (401, (500, "error")),
        (408, (500, "error")),
        (429, (500, "error")),
        (504, (500, "error")),
        (422, (500, "error")),
    ],
)
@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_leg_error_code(leg: str, status: int, expected: tuple[int, str]) -> None:
    status_out, suffix = expected
    assert leg_error_code(leg, status) == (status_out, f"{leg}_{suffix}")


def test_leg_error_code_rejects_unknown_leg() -> None:
    with pytest.raises(ValueError):
        leg_error_code("regular", 500)


def test_decode_leg_error_uses_decode_message() -> None:
    body = json.dumps({"error": {"message": "context too long", "type": "BadRequestError"}}).encode()
    err = leg_error("decode", 400, body)
    assert (err.status, err.code, err.message) == (400, "decode_bad_request", "context too long")
    # FastAPI style and plain text bodies.
    assert leg_error("decode", 503, b'{"detail": "overloaded"}').message == "overloaded"
    assert leg_error("decode", 500, b"boom").message == "boom"


def test_prefill_leg_error_embeds_body() -> None:
    err = leg_error("prefill", 404, b'{"detail":"Not Found"}')
    assert (err.status, err.code) == (404, "prefill_not_found")
    assert '{"detail":"Not Found"}' in err.message


def test_leg_error_bounds_embedded_body() -> None:
    err = leg_error("prefill", 500, b"x" * 100_000)
    assert len(err.message) < 5000


def test_sse_error_is_complete_event_then_done() -> None:
    out = sse_error('decode said "no"', 503)
    assert out.endswith(b"\n\ndata: [DONE]\n\n")
    events = out.split(b"\n\n")
    assert events[-1] == b""
    assert events[1] == b"data: [DONE]"
    assert events[0].startswith(b"data: ")
    assert json.loads(events[0][6:]) == {"error": {"message": 'decode said "no"', "status": 503}}


def test_unknown_url() -> None:
    err = errors.unknown_url("GET", "/x")
    assert json.loads(err.body()) == {
        "error": {
            "type": "invalid_request_error",
            "code": "unknown_url",
            "message": "Invalid URL (GET /x)",
            "param": None,
        }
    }
    assert err.status == 404


def test_router_error_carries_fields() -> None:
    err = RouterError(413, "payload_too_large", "too big")
    assert (err.status, err.code, err.message) == (413, "payload_too_large", "too big")
    assert json.loads(err.body())["error"]["code"] == "payload_too_large"
    assert err.sse().endswith(b"data: [DONE]\n\n")
    assert isinstance(err, Exception)
    with pytest.raises(RouterError) as info:
        raise err
    assert info.value.status == 413


def test_factories_statuses() -> None:
    assert errors.no_available_workers("decode").status == 503
    assert errors.no_available_workers().code == "no_available_workers"
    assert errors.payload_too_large(2000, 1000).status == 413
    assert errors.queue_full().status == 429
    assert errors.queue_timeout().status == 408
    assert errors.bad_gateway().status == 502
    assert errors.gateway_timeout().status == 504
    auth = errors.invalid_api_key()
    assert auth.status == 401 and auth.code == "invalid_api_key"
    assert (b"WWW-Authenticate", b'Bearer realm="data-plane"') in auth.headers


def test_non_string_message_is_stringified() -> None:
    exc = ConnectionResetError("peer reset")
    assert json.loads(error_response(502, "bad_gateway", exc))["error"]["message"] == "peer reset"
    assert b'"message": "peer reset"' in sse_error(exc, 502)
