"""The SGLang API as the simulator speaks it: inference bodies parsed into ``ParsedGen`` (the
estimate of input tokens included) and the response bodies and SSE events written back.

Batches (protocol.md 3.3: ``input_ids`` list of lists, ``text`` list, ``prompt`` list, chat
``n > 1``) run as one request per item, each with its own room (a list, or a scalar room
expanded to room, room+1, ... as SGLang does) and rank; ``/generate`` answers a JSON list, the
OpenAI paths one body with a choice per item; stream events carry the item's index. Streaming
``/generate`` events carry the new token only (incremental), not SGLang's cumulative text, so a
long stream stays O(tokens) bytes.
"""

from __future__ import annotations

import functools
import json
import math
import time
from typing import Any

from fastroute.dataplane import body as _router_body
from fastroute.sim.engine import BadRequest, DecodeReq, ParsedGen, SimParams
from fastroute.sim.http import Responder
from fastroute.sim.prefixcache import block_hashes, token_block_hashes


def estimate_text_tokens(text: str, chars_per_token: float = 4.0) -> int:
    """Token count the simulator assumes for ``text`` (no tokenizer): the router's own estimate
    (``body.estimate_tokens``, ceil(utf-8 bytes / 4)), so both sides agree on what a text request
    weighs; another ``chars_per_token`` scales the same byte count."""
    if chars_per_token == 4.0:
        return _router_body.estimate_tokens(text)
    n = len(text.encode("utf-8", "surrogatepass"))
    return math.ceil(n / chars_per_token) if n else 0


def _int_field(obj: dict, name: str) -> int | None:
    v = obj.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequest(f"{name} must be an integer")
    return v


def _per_item(obj: dict, name: str, b: int, check: Any) -> list:
    """A scalar or a per-item list field of a batch, as ``b`` values (checked by ``check``)."""
    v = obj.get(name)
    if isinstance(v, list):
        if len(v) != b:
            raise BadRequest(f"{name} has {len(v)} entries for a batch of {b}")
        return [check(x, name) for x in v]
    return [check(v, name)] * b


def _chk_int(v: Any, name: str) -> int | None:
    if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
        raise BadRequest(f"{name} must be an integer")
    return v


def _chk_str(v: Any, name: str) -> str | None:
    return v if isinstance(v, str) else None


def _chk_max_new(v: Any, default: int) -> int:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise BadRequest("max_new_tokens must be a positive integer")
    return v


def parse_inference(path: str, body: bytes, params: SimParams) -> ParsedGen:
    try:
        obj = json.loads(body) if body else {}
    except ValueError as exc:
        raise BadRequest(f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise BadRequest("body must be a JSON object")
    cpt = params.chars_per_token
    per_item: list[int] | None = None  # input tokens per item when the body is a batch
    item_max_new: list[int] | None = None
    if path == "/generate":
        kind = "generate"
        ids = obj.get("input_ids")
        text = obj.get("text")
        if isinstance(ids, list):
            if ids and isinstance(ids[0], list):
                per_item = [len(x) if isinstance(x, list) else _bad_item("input_ids") for x in ids]
            n_in = len(ids)
        elif isinstance(text, str):
            n_in = estimate_text_tokens(text, cpt)
        elif isinstance(text, list):
            per_item = [estimate_text_tokens(t, cpt) if isinstance(t, str) else _bad_item("text") for t in text]
        else:
            raise BadRequest("either text or input_ids should be provided")
        sp = obj.get("sampling_params") or {}
        if isinstance(sp, list) and per_item is not None and len(sp) == len(per_item):
            item_max_new = [
                _chk_max_new(x.get("max_new_tokens") if isinstance(x, dict) else None, params.max_new_tokens)
                for x in sp
            ]
        elif not isinstance(sp, dict):
            raise BadRequest("sampling_params must be an object")
        max_new = sp.get("max_new_tokens") if isinstance(sp, dict) else None
    elif path == "/v1/completions":
        kind = "completions"
        prompt = obj.get("prompt")
        if isinstance(prompt, str):
            n_in = estimate_text_tokens(prompt, cpt)
        elif isinstance(prompt, list) and (not prompt or isinstance(prompt[0], int)):
            n_in = len(prompt)
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            per_item = [estimate_text_tokens(t, cpt) if isinstance(t, str) else _bad_item("prompt") for t in prompt]
        elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            per_item = [len(x) if isinstance(x, list) else _bad_item("prompt") for x in prompt]
        else:
            raise BadRequest("prompt must be a string or a list of token ids")
        max_new = obj.get("max_tokens")
    else:
        kind = "chat"
        msgs = obj.get("messages")
        if not isinstance(msgs, list):
            raise BadRequest("messages must be a list")
        n_in = _router_body._CHAT_TOKENS_PER_MESSAGE * len(msgs)  # as the router estimates it
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                n_in += estimate_text_tokens(c, cpt)
            elif isinstance(c, list):
                for part in c:
                    if isinstance(part, dict) and isinstance(part.get("text"), str):
                        n_in += estimate_text_tokens(part["text"], cpt)
        max_new = obj.get("max_completion_tokens", obj.get("max_tokens"))
        n = obj.get("n")
        per_item = [n_in] * n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None
    max_new = _chk_max_new(max_new, params.max_new_tokens)
    so = obj.get("stream_options")
    stream = bool(obj.get("stream", False))
    return_logprob = bool(obj.get("return_logprob", False))
    include_usage = isinstance(so, dict) and bool(so.get("include_usage"))
    named = obj.get("model")
    model = named if isinstance(named, str) else params.model
    if per_item is not None:
        bg = _parse_batch(
            obj, kind, per_item, item_max_new or [max_new] * len(per_item), stream, return_logprob, include_usage, model
        )
        if params.prefix_cache_tokens > 0 and kind == "generate" and isinstance(ids, list):
            for it, item_ids in zip(bg.items, ids):
                _token_blocks(it, item_ids, params)
        return bg
    room = _int_field(obj, "bootstrap_room")
    port = obj.get("bootstrap_port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
        raise BadRequest("bootstrap_port must be an integer or null")
    host = obj.get("bootstrap_host")
    rank = _int_field(obj, "routed_dp_rank")
    if rank is None:
        rank = _int_field(obj, "data_parallel_rank")
    g = ParsedGen(
        kind,
        stream,
        n_in,
        max_new,
        room,
        host if isinstance(host, str) else None,
        port,
        rank,
        return_logprob,
        include_usage,
        model,
    )
    g.prefill_rank = _int_field(obj, "disagg_prefill_dp_rank")
    tokenized = _tokenize(obj, kind, params) if params.tokenizer_path else None
    if tokenized is not None:
        g.input_tokens = len(tokenized)
        if params.prefix_cache_tokens > 0:
            _token_blocks(g, tokenized, params)
    elif params.prefix_cache_tokens > 0 and kind == "generate":
        if isinstance(ids, list):
            _token_blocks(g, ids, params)
        elif isinstance(text, str):
            g.blocks = block_hashes(text.encode(), int(params.prefix_block_tokens * cpt))
    g.items = [g]
    return g


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str) -> Any:
    from fastroute.dataplane.tokenize import ModelTokenizer

    return ModelTokenizer(path)


def _tokenize(obj: dict, kind: str, params: SimParams) -> list[int] | None:
    """A scalar text or chat prompt's token ids with the server's tokenizer (SGLang renders a
    chat with the model's template first); None for input_ids, which are taken as they are."""
    tok = _tokenizer(params.tokenizer_path)
    try:
        if kind == "chat":
            return tok.encode(tok.render(obj["messages"], obj.get("tools")), False)
        value = obj.get("prompt") if kind == "completions" else obj.get("text")
        return tok.encode(value, True) if isinstance(value, str) else None
    except Exception as exc:  # the template or the tokenizer refused it: SGLang answers 400
        raise BadRequest(f"tokenizing the prompt failed: {exc}") from None


def _token_blocks(g: ParsedGen, ids: list, params: SimParams) -> None:
    """A token id prompt's cache blocks: hashed from the ids, which BlockStored carries."""
    try:
        g.blocks = token_block_hashes(ids, params.prefix_block_tokens)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    g.token_ids = ids


def _bad_item(name: str) -> int:
    raise BadRequest(f"{name}: every batch item must have the same type")


def _parse_batch(
    obj: dict,
    kind: str,
    per_item: list[int],
    max_new: list[int],
    stream: bool,
    return_logprob: bool,
    include_usage: bool,
    model: str,
) -> ParsedGen:
    """A batch of B (protocol.md 3.3): bootstrap keys and rank keys may be scalars or lists of B.

    A scalar room is expanded to room, room+1, ... like SGLang does for parallel sampling."""
    b = len(per_item)
    if b == 0:
        raise BadRequest("empty batch")
    rooms = _per_item(obj, "bootstrap_room", b, _chk_int)
    if rooms and not isinstance(obj.get("bootstrap_room"), list) and rooms[0] is not None:
        rooms = [rooms[0] + i for i in range(b)]
    ports = _per_item(obj, "bootstrap_port", b, _chk_int)
    hosts = _per_item(obj, "bootstrap_host", b, _chk_str)
    ranks = _per_item(obj, "routed_dp_rank", b, _chk_int)
    if all(r is None for r in ranks):
        ranks = _per_item(obj, "data_parallel_rank", b, _chk_int)
    items = [
        ParsedGen(
            kind,
            stream,
            per_item[i],
            max_new[i],
            rooms[i],
            hosts[i],
            ports[i],
            ranks[i],
            return_logprob,
            include_usage,
            model,
            i,
        )
        for i in range(b)
    ]
    for it, pr in zip(items, _per_item(obj, "disagg_prefill_dp_rank", b, _chk_int)):
        it.prefill_rank = pr
    g = ParsedGen(
        kind,
        stream,
        sum(per_item),
        max(max_new),
        rooms[0],
        hosts[0],
        ports[0],
        ranks[0],
        return_logprob,
        include_usage,
        model,
        0,
        b,
        items,
    )
    return g


# ---------------------------------------------------------------------------------------------
# Response bodies


def _finish(n: int) -> dict:
    return {"type": "length", "length": n}


def _generate_body(rid: str, g: ParsedGen, n_out: int, role: str) -> dict:
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish(n_out),
        "prompt_tokens": g.input_tokens,
        "completion_tokens": n_out,
        "cached_tokens": 0,
    }
    if g.return_logprob:
        if role == "prefill":
            meta["input_token_logprobs"] = [[-1.0, 1, None] for _ in range(g.input_tokens)]
        else:
            meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[-0.5, 1, None] for _ in range(n_out)]
    return {"text": " t" * n_out, "output_ids": [1] * n_out, "meta_info": meta}


def _openai_body(rid: str, g: ParsedGen, outs: list[int]) -> dict:
    """One OpenAI response for all items of ``g`` (choices by index); ``outs`` = tokens per item."""
    n_out = sum(outs)
    # n > 1 samples one prompt: it counts once; a batch of prompts counts each.
    n_in = g.items[0].input_tokens if g.kind == "chat" else g.input_tokens
    usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
    if g.kind == "chat":
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": " t" * k},
                "finish_reason": "length",
                "logprobs": None,
            }
            for i, k in enumerate(outs)
        ]
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": g.model,
            "choices": choices,
            "usage": usage,
        }
    choices = [{"index": i, "text": " t" * k, "finish_reason": "length", "logprobs": None} for i, k in enumerate(outs)]
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": g.model,
        "choices": choices,
        "usage": usage,
    }


def _make_emitter(resp: Responder, rid: str, g: ParsedGen) -> Any:
    """Per-token SSE writer for one streaming request; the constant parts are encoded once."""
    if g.kind == "generate":
        head = (
            b'data: {"text":" t","output_ids":[1],"meta_info":{"id":"'
            + rid.encode()
            + b'","prompt_tokens":'
            + str(g.input_tokens).encode()
            + b',"completion_tokens":'
        )
        last = g.max_new

        tail_mid = b',"finish_reason":null},"index":%d}\n\n' % g.index
        tail_end = b',"finish_reason":{"type":"length","length":%d}},"index":' + b"%d" % g.index + b"}\n\n"

        def emit(req: DecodeReq) -> None:
            n = req.generated
            if n < last:
                resp.write_chunk(head + b"%d" % n + tail_mid)
            else:
                resp.write_chunk(head + b"%d" % n + tail_end % n)

        return emit
    created = int(time.time())
    if g.kind == "chat":
        head = (
            b'data: {"id":"'
            + rid.encode()
            + b'","object":"chat.completion.chunk","created":'
            + str(created).encode()
            + b',"model":'
            + json.dumps(g.model).encode()
            + b',"choices":[{"index":%d,"delta":{' % g.index
        )
        mid_first = b'"role":"assistant","content":" t"},"logprobs":null,"finish_reason":'
        mid = b'"content":" t"},"logprobs":null,"finish_reason":'
    else:
        head = (
            b'data: {"id":"'
            + rid.encode()
            + b'","object":"text_completion","created":'
            + str(created).encode()
            + b',"model":'
            + json.dumps(g.model).encode()
            + b',"choices":[{"index":%d,' % g.index
        )
        mid_first = mid = b'"text":" t","logprobs":null,"finish_reason":'
    last = g.max_new

    def emit_oa(req: DecodeReq) -> None:
        n = req.generated
        fin = b'"length"' if n >= last else b"null"
        resp.write_chunk(head + (mid_first if n == 1 else mid) + fin + b"}]}\n\n")

    return emit_oa


def _usage_event(rid: str, g: ParsedGen, n_out: int) -> bytes:
    n_in = g.items[0].input_tokens if g.kind == "chat" else g.input_tokens
    obj: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk" if g.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": g.model,
        "choices": [],
        "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"
