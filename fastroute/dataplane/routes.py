"""The inference route table: every POST path the router proxies, and what each one means.

One :class:`RouteSpec` per client path, built at import and never per request: the endpoint
label (metrics, body rules), whether PD mode can serve it, the input-token estimate that feeds
the load ledger, and the request-id prefix. :mod:`fastroute.dataplane.protocol` derives its
path set and request-id prefixes from :data:`ROUTES`; :mod:`fastroute.dataplane.app` looks the
spec up once per request (the same dict lookup it did before for the label).

Which routes and how (sglang-router 0.3.2 / smg HTTP routers, read from their route tables):

* ``/generate``, ``/v1/completions``, ``/v1/chat/completions``: regular and PD; their bodies
  are parsed by :func:`fastroute.dataplane.body.parse_request` (batch rules, tokens).
* ``/v1/embeddings``, ``/v1/rerank`` (and ``/rerank``), ``/v1/score``, ``/v1/classify``:
  one forward pass, no decode, so nothing for a PD pair to split; the peers' PD routers answer
  them ``501 Not Implemented`` and so does fastroute (:func:`pd_unsupported`).
* ``/v1/tokenize``, ``/v1/detokenize``: no GPU work; token estimate 0 so they never weigh on
  the token ledger. Regular mode only (PD answers 501 like the peers' PD router).
* ``/v1/responses``, ``/v1/messages``: generation routes that stream when asked; forwarded
  as-is to a regular worker (the peers serve them through their regular/OpenAI routers only).

The estimates reuse :func:`fastroute.dataplane.body.estimate_tokens` (ceil(utf8 bytes / 4)), so
every route is measured on the same scale as chat and completions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastroute.dataplane.body import estimate_tokens
from fastroute.errors import RouterError

__all__ = ["RouteSpec", "ROUTES", "INFERENCE", "RID_PREFIX", "pd_unsupported", "CODE_NOT_IMPLEMENTED"]

CODE_NOT_IMPLEMENTED = "not_implemented"

_MESSAGE_TOKENS = 4  # template tokens per chat/messages turn, as body.py counts for chat


def _text_tokens(value: Any) -> int:
    """Tokens of a string, a list of strings, a list of ids or a list of id lists (else 0).

    Shallow on purpose, like body.py: the worker validates shapes; the router only needs a
    consistent measure, and a malformed field costs 0 rather than a 400 the worker would give.
    """
    t = type(value)
    if t is str:
        return estimate_tokens(value)
    if t is not list or not value:
        return 0
    first = type(value[0])
    if first is int:
        return len(value)  # one tokenized input
    total = 0
    for item in value:
        ti = type(item)
        if ti is str:
            total += estimate_tokens(item)
        elif ti is list:
            total += len(item)
        elif ti is dict:  # content parts / response input items
            total += _item_tokens(item)
    return total


def _item_tokens(item: dict) -> int:
    text = item.get("text")
    if type(text) is str:
        return estimate_tokens(text)
    content = item.get("content")
    if content is not None:
        return _MESSAGE_TOKENS + _text_tokens(content)
    return 0


def _input_tokens(obj: dict) -> int:
    """/v1/embeddings, /v1/classify: ``input`` (string, strings, ids or id lists)."""
    return _text_tokens(obj.get("input"))


def _rerank_tokens(obj: dict) -> int:
    """/v1/rerank: the query is scored against every document, so it counts once per document."""
    docs = obj.get("documents")
    n = len(docs) if type(docs) is list else 0
    return _text_tokens(obj.get("query")) * max(n, 1) + _text_tokens(docs)


def _score_tokens(obj: dict) -> int:
    """/v1/score: query + items, the query repeated per item like rerank."""
    items = obj.get("items")
    n = len(items) if type(items) is list else 0
    return _text_tokens(obj.get("query")) * max(n, 1) + _text_tokens(items)


def _responses_tokens(obj: dict) -> int:
    """/v1/responses: ``instructions`` plus ``input`` (a string or a list of input items)."""
    return _text_tokens(obj.get("instructions")) + _text_tokens(obj.get("input"))


def _messages_tokens(obj: dict) -> int:
    """/v1/messages (Anthropic shape): ``system`` plus each message's content."""
    total = _text_tokens(obj.get("system"))
    messages = obj.get("messages")
    if type(messages) is list:
        for msg in messages:
            if type(msg) is dict:
                total += _MESSAGE_TOKENS + _text_tokens(msg.get("content"))
    return total


def _no_tokens(obj: dict) -> int:
    return 0


class RouteSpec:
    """One proxied route (immutable). ``tokens`` is None where body.parse_request already
    estimates (generate, completions, chat), else a function of the parsed body."""

    __slots__ = ("path", "endpoint", "pd", "tokens", "rid_prefix")

    def __init__(
        self, path: str, endpoint: str, pd: bool, tokens: Callable[[dict], int] | None, rid_prefix: bytes
    ) -> None:
        self.path = path
        self.endpoint = endpoint
        self.pd = pd
        self.tokens = tokens
        self.rid_prefix = rid_prefix

    def __repr__(self) -> str:
        return f"RouteSpec({self.path!r}, pd={self.pd})"


_TABLE = (
    # path                   endpoint label           PD     tokens              rid prefix
    ("/generate", "/generate", True, None, b"gnt-"),
    ("/v1/completions", "/v1/completions", True, None, b"cmpl-"),
    ("/v1/chat/completions", "/v1/chat/completions", True, None, b"chatcmpl-"),
    ("/v1/embeddings", "/v1/embeddings", False, _input_tokens, b"embd-"),
    ("/v1/rerank", "/v1/rerank", False, _rerank_tokens, b"rerank-"),
    ("/rerank", "/v1/rerank", False, _rerank_tokens, b"rerank-"),
    ("/v1/score", "/v1/score", False, _score_tokens, b"score-"),
    ("/v1/classify", "/v1/classify", False, _input_tokens, b"classify-"),
    ("/v1/tokenize", "/v1/tokenize", False, _no_tokens, b"tok-"),
    ("/v1/detokenize", "/v1/detokenize", False, _no_tokens, b"detok-"),
    ("/v1/responses", "/v1/responses", False, _responses_tokens, b"resp_"),
    ("/v1/messages", "/v1/messages", False, _messages_tokens, b"msg_"),
)

# Raw client path -> spec (the one lookup per request).
ROUTES: dict[bytes, RouteSpec] = {p.encode(): RouteSpec(p, e, pd, tok, rid) for p, e, pd, tok, rid in _TABLE}
# Raw path -> endpoint label (metrics labels, body rules); the set of proxied paths.
INFERENCE: dict[bytes, str] = {p: spec.endpoint for p, spec in ROUTES.items()}
RID_PREFIX: dict[bytes, bytes] = {p: spec.rid_prefix for p, spec in ROUTES.items()}
# Raw path -> the peers' `endpoint` metric label (smg_router_*): generate, completions, chat,
# embeddings, rerank, ...
ENDPOINT_LABEL: dict[bytes, str] = {
    p: "chat" if spec.endpoint == "/v1/chat/completions" else spec.endpoint.rsplit("/", 1)[-1]
    for p, spec in ROUTES.items()
}


def pd_unsupported(path: str) -> RouterError:
    """501 for a route PD mode cannot serve, as the peers' PD routers answer it."""
    return RouterError(
        501,
        CODE_NOT_IMPLEMENTED,
        f"{path} is not supported in PD disaggregation mode "
        "(it needs a regular worker: run a router without --pd-disaggregation)",
    )
