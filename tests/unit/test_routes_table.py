"""The route table's token estimates (no sockets)."""

from __future__ import annotations

from fastroute.dataplane.routes import INFERENCE, ROUTES
from fastroute.dataplane.wire import new_request_id


def tokens(path: str, obj: dict) -> int:
    return ROUTES[path.encode()].tokens(obj)


def test_estimates_per_route() -> None:
    assert tokens("/v1/embeddings", {"input": "x" * 40}) == 10
    assert tokens("/v1/embeddings", {"input": ["x" * 40, "y" * 8]}) == 12
    assert tokens("/v1/embeddings", {"input": [1, 2, 3]}) == 3  # one tokenized input
    assert tokens("/v1/embeddings", {"input": [[1, 2], [3]]}) == 3
    assert tokens("/v1/embeddings", {"input": 7}) == 0  # malformed: the worker says
    # the query is scored against each document
    assert tokens("/v1/rerank", {"query": "q" * 8, "documents": ["a" * 4, "b" * 4, "c" * 4]}) == 9
    assert tokens("/rerank", {"query": "q" * 8}) == 2
    assert tokens("/v1/score", {"query": "q" * 4, "items": ["a" * 4, "b" * 4]}) == 4
    assert tokens("/v1/classify", {"input": "z" * 12}) == 3
    assert tokens("/v1/tokenize", {"prompt": "z" * 400}) == 0
    assert tokens("/v1/detokenize", {"tokens": [1, 2, 3]}) == 0
    assert tokens("/v1/responses", {"instructions": "i" * 4, "input": "x" * 8}) == 3
    assert tokens("/v1/responses", {"input": [{"role": "user", "content": "x" * 8}]}) == 6
    assert (
        tokens(
            "/v1/messages",
            {
                "system": "s" * 4,
                "messages": [
                    {"role": "user", "content": "x" * 8},
                    {"role": "user", "content": [{"type": "text", "text": "y" * 4}]},
                ],
            },
        )
        == 12
    )


def test_protocol_uses_the_table() -> None:
    assert {p: s.endpoint for p, s in ROUTES.items()} == INFERENCE
    assert new_request_id(b"/v1/embeddings").startswith(b"embd-")
    assert new_request_id(b"/v1/chat/completions").startswith(b"chatcmpl-")
    assert new_request_id(b"/other").startswith(b"req-")
