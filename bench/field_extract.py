"""How much does reading a request's routing fields cost, per decoder and body size?

The router needs a handful of fields of each client body (model, stream, max tokens, n,
return_logprob, the input length: ids count or text length, and a few keys it refuses). Today it
builds the whole object tree with json's C scanner and reads the fields from it. This compares,
on chat and /generate bodies of ~0.1, 2 and 48 KB (distinct bodies, as real users send):

* ``json-scanner``: the full parse (``body._parse_full``: json's C scanner, the whole tree) and
  the field reads, what ``parse_request`` did before fields.py;
* ``parse_request``: fastroute's parse now (fields.py's msgspec pick, then the same reads);
* ``orjson``: ``orjson.loads`` then the same field reads (if orjson is installed);
* ``msgspec-any``: ``msgspec.json.decode`` to Python objects, same field reads;
* ``msgspec-typed``: ``msgspec.json.decode(type=Struct)`` of only the fields a pick needs (the
  decoder skips every other key in C; chat message contents are decoded, since their length is
  the input estimate);
* ``msgspec-typed-raw``: the same, but in a body without a backslash prompt strings kept as
  ``msgspec.Raw`` (a view of their JSON bytes): the UTF-8 length of an ASCII one is its raw
  length less the quotes (a body with a backslash takes ``msgspec-typed``);
* ``parse_request+text``: ``parse_request`` then ``routing_text()``, what a request costs under
  a policy that reads the text (cache_aware, the default).

Each row is the median over rounds of the per-call time (us) from ``timeit``; the ratio column is
against ``json-scanner``. Bodies: prose with now and then a line break (a JSON escape) and a
non-ASCII word; ``--ascii`` without the non-ASCII words; ``--plain`` neither (ASCII without an
escape, as bench/floor.py sends). ``--checkout DIR`` measures the fastroute of another checkout
(built there), e.g. the base of a change. Usage:
``python bench/field_extract.py [--rounds N] [--ascii | --plain] [--checkout DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _checkout() -> str:
    # --checkout is read before fastroute is imported: the import picks the tree.
    if "--checkout" in sys.argv[1:-1]:
        return str(Path(sys.argv[sys.argv.index("--checkout") + 1]).resolve())
    return str(Path(__file__).resolve().parent.parent)


sys.path.insert(0, _checkout())

import msgspec  # noqa: E402

from fastroute.dataplane import body as _body  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import WORDS  # noqa: E402  (the words the floor benchmark's bodies are made of)

try:
    import orjson
except ImportError:  # optional: only measured when present
    orjson = None

# Real prompts: mostly ASCII, lines (JSON \n escapes), now and then a non-ASCII word.
ASCII = False  # --ascii: no non-ASCII words (escapes only)
PLAIN = False  # --plain: neither non-ASCII words nor escapes
RARE = ("caf\u00e9", "na\u00efve", "\u4f60\u597d", "\n", "\n\n")


def prose(rng: random.Random, size: int) -> str:
    out, n = [], 0
    while n < size:
        w = rng.choice(WORDS) if PLAIN or rng.random() > 0.03 else rng.choice(RARE[3:] if ASCII else RARE)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def chat_body(rng: random.Random, size: int) -> bytes:
    turns = max(1, size // 600)
    per = max(8, (size - 120) // (turns + 1))
    msgs = [{"role": "system", "content": prose(rng, per)}]
    for i in range(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": prose(rng, per)})
    obj = {
        "model": "bench-model",
        "messages": msgs,
        "max_tokens": 128,
        "stream": False,
        "temperature": 0.7,
        "top_p": 0.95,
    }
    return json.dumps(obj, ensure_ascii=False).encode()


def generate_body(rng: random.Random, size: int) -> bytes:
    obj = {
        "text": prose(rng, max(8, size - 110)),
        "sampling_params": {"max_new_tokens": 128, "temperature": 0.7},
        "stream": False,
    }
    return json.dumps(obj, ensure_ascii=False).encode()


# --- msgspec typed: only the fields the router reads ------------------------------------


class Part(msgspec.Struct):
    text: str | None = None


class Message(msgspec.Struct):
    content: str | list[Part] | None = None


class ChatFields(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    n: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    return_logprob: bool | None = None
    messages: list[Message] | None = None


class Sampling(msgspec.Struct):
    max_new_tokens: int | None = None


class GenerateFields(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    text: str | list[str] | None = None
    input_ids: list[Any] | None = None
    sampling_params: Sampling | None = None
    return_logprob: bool | None = None


class RawMessage(msgspec.Struct):
    content: msgspec.Raw = msgspec.Raw()


class RawChat(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    n: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    return_logprob: bool | None = None
    messages: list[RawMessage] | None = None


class RawGenerate(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    text: msgspec.Raw = msgspec.Raw()
    input_ids: msgspec.Raw = msgspec.Raw()
    sampling_params: Sampling | None = None
    return_logprob: bool | None = None


def raw_tokens(raw: msgspec.Raw) -> int:
    """Token estimate of a raw JSON string of an ASCII body without escapes: no decode.
    (Counting escapes instead was measured too: bytes.count and find of a two-byte needle
    cost more per 48 KB than msgspec's whole string decode.)"""
    if memoryview(raw)[0] != 0x22:
        raise ValueError("not a string")  # (the bench bodies' prompts are strings)
    return (len(raw) + 1) >> 2


def raw_chat(b: bytes) -> int:
    if b"\\" in b or not b.isascii():
        return typed_chat(b)
    f = _raw_chat_dec.decode(b)
    tokens = 0
    for m in f.messages or ():
        tokens += 4
        tokens += raw_tokens(m.content)
    return tokens


def raw_generate(b: bytes) -> int:
    if b"\\" in b or not b.isascii():
        return typed_generate(b)
    f = _raw_gen_dec.decode(b)
    return raw_tokens(f.text)


_raw_chat_dec = msgspec.json.Decoder(RawChat)
_raw_gen_dec = msgspec.json.Decoder(RawGenerate)
_chat_dec = msgspec.json.Decoder(ChatFields)
_gen_dec = msgspec.json.Decoder(GenerateFields)
_any_dec = msgspec.json.Decoder()


def typed_chat(b: bytes) -> int:
    f = _chat_dec.decode(b)
    tokens = 0
    for m in f.messages or ():
        tokens += 4
        c = m.content
        if type(c) is str:
            tokens += _body.estimate_tokens(c)
        elif c is not None:
            for p in c:
                if p.text is not None:
                    tokens += _body.estimate_tokens(p.text)
    return tokens


def typed_generate(b: bytes) -> int:
    f = _gen_dec.decode(b)
    t = f.text
    return _body.estimate_tokens(t) if type(t) is str else 0


def with_reads(loads: Callable[[bytes], Any], path: str) -> Callable[[bytes], Any]:
    parser = _body._PARSERS[path]

    def run(b: bytes) -> Any:
        obj = loads(b)
        meta = _body.RequestMeta(obj, obj.get("stream") or False, None, 0, False, None, obj.get("model"), path)
        parser(obj, meta)
        return meta.input_tokens

    return run


def _text(meta: Any) -> int:
    text = meta.routing_text()
    return meta.input_tokens + len(text or "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", type=int, default=64)
    shape = ap.add_mutually_exclusive_group()
    shape.add_argument("--ascii", action="store_true", help="ASCII bodies (JSON escapes only)")
    shape.add_argument("--plain", action="store_true", help="ASCII bodies without escapes")
    ap.add_argument("--checkout", default=None, help="measure the fastroute of this checkout")
    args = ap.parse_args(argv)
    global ASCII, PLAIN
    ASCII, PLAIN = args.ascii, args.plain
    rng = random.Random(1)
    rows = []
    for kind, path, make in (("chat", _body.CHAT, chat_body), ("generate", _body.GENERATE, generate_body)):
        for size in (100, 2048, 48 * 1024):
            bodies = [make(rng, size) for _ in range(args.variants)]
            methods: dict[str, Callable[[bytes], Any]] = {
                "json-scanner": with_reads(_body._parse_full, path),
                "parse_request": lambda b, p=path: _body.parse_request(p, b).input_tokens,
                "parse_request+text": lambda b, p=path: _text(_body.parse_request(p, b)),
                "msgspec-any": with_reads(_any_dec.decode, path),
                "msgspec-typed": typed_chat if kind == "chat" else typed_generate,
                "msgspec-typed-raw": raw_chat if kind == "chat" else raw_generate,
            }
            if orjson is not None:
                methods["orjson"] = with_reads(orjson.loads, path)
            ref = [methods["json-scanner"](b) for b in bodies]
            for name, fn in methods.items():
                if name != "parse_request+text":
                    assert [fn(b) for b in bodies] == ref, (name, kind, size)
            number = max(20, 200_000 // (size * 2))
            samples: dict[str, list[float]] = {n: [] for n in methods}
            for _ in range(args.rounds):
                for name, fn in methods.items():  # alternated within each round

                    def loop(fn: Callable[[bytes], Any] = fn, bodies: list[bytes] = bodies) -> None:
                        for b in bodies:
                            fn(b)

                    t = timeit.timeit(loop, number=number)
                    samples[name].append(t / number / len(bodies) * 1e6)
            base = statistics.median(samples["json-scanner"])
            avg = sum(map(len, bodies)) / len(bodies)
            for name in methods:
                med = statistics.median(samples[name])
                rows.append((kind, f"{avg / 1024:.1f} KB", name, med, med / base))
    shape = "plain" if PLAIN else "ascii" if ASCII else "mixed"
    print(
        f"fastroute from {Path(_body.__file__).parent.parent.parent}, {shape} bodies; "
        f"Python {sys.version.split()[0]}, msgspec {msgspec.__version__}, "
        f"orjson {orjson.__version__ if orjson else 'absent'}; {args.rounds} rounds, "
        f"{args.variants} distinct bodies per size"
    )
    print("| body | size | decoder | us/request | vs json-scanner |")
    print("|---|---|---|---|---|")
    for kind, size_s, name, med, ratio in rows:
        print(f"| {kind} | {size_s} | {name} | {med:.2f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
