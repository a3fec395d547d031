"""Exact tokens (dataplane/tokenize.py) with a real tokenizer built in the test: counts, the
chat template's ids, the caches, the thread pool, the timeout and the fallbacks."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from fastroute.dataplane import tokenize
from fastroute.dataplane.body import parse_request
from fastroute.dataplane.tokenize import ModelTokenizer, TokenizerError, Tokens
from tests.tokenizer_fixture import build, ids


def _meta(path: str, obj: dict) -> Any:
    import json

    return parse_request(path, json.dumps(obj).encode())


def test_text_is_counted_and_chat_renders_the_template_ids(tmp_path) -> None:
    tok = ModelTokenizer(build(str(tmp_path)))
    toks = Tokens({None: tok}, 50.0)
    m = _meta("/generate", {"text": "hello world , how are you ?"})
    assert toks.start(m, "/generate", None, lambda: None)
    assert m.token_ids == tok.tokenizer.encode("hello world , how are you ?").ids
    assert m.input_tokens == len(m.token_ids) and m.routing_ids() == m.token_ids
    chat = {"messages": [{"role": "system", "content": "you are a bot"}, {"role": "user", "content": "hello ?"}]}
    m = _meta("/v1/chat/completions", chat)
    assert toks.start(m, "/v1/chat/completions", None, lambda: None)
    expected = ids("<s>", "<|im_start|>", "system", "you", "are", "a", "bot", "<|im_end|>")
    expected += ids("<|im_start|>", "user", "hello", "?", "<|im_end|>", "<|im_start|>", "assistant")
    assert m.token_ids == expected
    assert m.input_tokens == len(expected)
    assert toks.exact["inline"] == 2
    # input_ids are taken as they are: nothing to tokenize
    m = _meta("/generate", {"input_ids": [5, 6, 7]})
    assert toks.start(m, "/generate", None, lambda: None) and m.token_ids is None and m.routing_ids() == [5, 6, 7]


def test_a_broken_template_keeps_the_estimate_and_counts_the_reason(tmp_path, caplog) -> None:
    bad = "{% for m in messages %}{{ raise_exception('no system role') }}{% endfor %}"
    tok = ModelTokenizer(build(str(tmp_path), template=bad))
    toks = Tokens({None: tok}, 50.0)
    for _ in range(2):
        m = _meta("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]})
        estimate = m.input_tokens
        assert toks.start(m, "/v1/chat/completions", None, lambda: None)
        assert m.token_ids is None and m.input_tokens == estimate
    assert toks.fallbacks["template"] == 2
    assert sum("no system role" in r.getMessage() for r in caplog.records) == 1  # said once


def test_a_template_that_does_not_compile_or_a_missing_file_stops_the_start(tmp_path) -> None:
    with pytest.raises(TokenizerError, match="tokenizer.json: missing"):
        ModelTokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="not a directory"):
        ModelTokenizer(str(tmp_path / "nope"))
    with pytest.raises(TokenizerError, match="does not compile"):
        ModelTokenizer(build(str(tmp_path / "t"), template="{% for %}"))
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a usable tokenizer"):
        ModelTokenizer(str(tmp_path / "u"))


def test_the_sandbox_refuses_what_a_template_must_not_do(tmp_path) -> None:
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = ModelTokenizer(build(str(tmp_path), template=evil))
    toks = Tokens({None: tok}, 50.0)
    m = _meta("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert toks.start(m, "/v1/chat/completions", None, lambda: None)
    assert m.token_ids is None and toks.fallbacks["template"] == 1


def test_l1_reuses_a_conversation_and_gives_the_same_ids(tmp_path) -> None:
    tok = ModelTokenizer(build(str(tmp_path)))
    assert tok.boundaries  # the word-level tokenizer splits at its special tokens
    plain = Tokens({None: tok}, 50.0)
    cached = Tokens({None: tok}, 50.0, l1=(True, 1 << 20))
    msgs: list[dict] = [{"role": "system", "content": "you are a bot"}]
    for turn in range(12):
        msgs.append({"role": "user", "content": f"w{turn} how are you ?"})
        a, b = _meta("/v1/chat/completions", {"messages": msgs}), _meta("/v1/chat/completions", {"messages": msgs})
        plain.start(a, "/v1/chat/completions", None, lambda: None)
        cached.start(b, "/v1/chat/completions", None, lambda: None)
        assert a.token_ids == b.token_ids
        msgs.append({"role": "assistant", "content": f"fine w{turn + 100}"})
    assert cached.l1 is not None and cached.l1.hits >= 10


def test_l0_hits_and_its_bounds(tmp_path) -> None:
    tok = ModelTokenizer(build(str(tmp_path)))
    toks = Tokens({None: tok}, 50.0, l0=(True, 2, 1 << 20))
    for text in ("hello", "world", "hello", "you", "hello", "world"):
        toks.start(_meta("/generate", {"text": text}), "/generate", None, lambda: None)
    assert toks.l0 is not None and toks.l0.hits == 2 and list(toks.l0._d) == ["hello", "world"] and len(toks.l0) == 2


class _Slow(ModelTokenizer):
    """The real tokenizer, held until the test releases it (a tokenizer slower than the bound)."""

    gate: threading.Event

    def encode(self, text: str, special: bool, release: bool = False) -> list[int]:
        self.gate.wait(5)
        return super().encode(text, special, release)


def test_a_long_prompt_goes_to_the_pool_and_the_timeout_keeps_the_estimate(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tokenize, "INLINE_BYTES", 16)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        tok = ModelTokenizer(build(str(tmp_path)))
        toks = Tokens({None: tok}, 2000.0)
        done = asyncio.Event()
        m = _meta("/generate", {"text": "hello world " * 50})
        assert not toks.start(m, "/generate", loop, done.set)
        await asyncio.wait_for(done.wait(), 5)
        assert m.input_tokens == 100 and toks.exact["pool"] == 1
        slow = _Slow(build(str(tmp_path / "s")))
        slow.gate = threading.Event()
        toks = Tokens({None: slow}, 20.0)
        done.clear()
        m = _meta("/generate", {"text": "hello world " * 50})
        estimate = m.input_tokens
        assert not toks.start(m, "/generate", loop, done.set)
        await asyncio.wait_for(done.wait(), 5)
        assert m.token_ids is None and m.input_tokens == estimate and toks.fallbacks["timeout"] == 1
        slow.gate.set()
        await asyncio.sleep(0.05)  # the late result lands and is ignored
        assert m.token_ids is None
        toks.close()

    asyncio.run(go())


def test_load_reads_the_config(tmp_path) -> None:
    base = dict(
        tokenizer_path=(),
        model_path=None,
        chat_template=None,
        tokenizer_cache_enable_l0=False,
        tokenizer_cache_l0_max_entries=10,
        tokenizer_cache_l0_max_memory=1000,
        tokenizer_cache_enable_l1=False,
        tokenizer_cache_l1_max_memory=1000,
        tokenize_timeout_ms=50.0,
    )
    assert tokenize.load(SimpleNamespace(**base)) is None
    a, b = build(str(tmp_path / "a")), build(str(tmp_path / "b"), template=None)
    toks = tokenize.load(SimpleNamespace(**{**base, "tokenizer_path": (a, f"other={b}")}))
    assert toks is not None and toks.for_model("x") is toks.tokenizers[None]
    assert not toks.for_model("other").has_template
    toks = tokenize.load(SimpleNamespace(**{**base, "model_path": a}))
    assert toks is not None and toks.for_model(None).has_template
    with pytest.raises(TokenizerError, match="given twice"):
        tokenize.load(SimpleNamespace(**{**base, "tokenizer_path": (a, a)}))


def test_the_pool_and_the_loop_share_the_caches_safely(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(tokenize, "INLINE_BYTES", 64)

    async def go() -> None:
        loop = asyncio.get_running_loop()
        tok = ModelTokenizer(build(str(tmp_path)))
        toks = Tokens({None: tok}, 5000.0, l0=(True, 50, 1 << 20), l1=(True, 1 << 20))
        metas, events = [], []
        for k in range(200):
            turns = [{"role": "user", "content": f"w{i % 200} hello world " * 8} for i in range(k % 7 + 1)]
            m = _meta("/v1/chat/completions", {"messages": turns})
            done = asyncio.Event()
            if toks.start(m, "/v1/chat/completions", loop, done.set):
                done.set()
            metas.append((m, turns))
            events.append(done)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 10)
        plain = Tokens({None: tok}, 0.0)
        for m, turns in metas:
            ref = _meta("/v1/chat/completions", {"messages": turns})
            plain.start(ref, "/v1/chat/completions", None, lambda: None)
            assert m.token_ids == ref.token_ids
        assert toks.exact["pool"] > 0 and toks.fallbacks["timeout"] == 0
        toks.close()

    asyncio.run(go())


def test_the_pool_lets_go_of_the_gil_while_it_tokenizes(tmp_path) -> None:
    """A 50 KB prompt tokenized in a thread leaves the interpreter to the event loop's thread:
    its longest pause is a fraction of one tokenization (encode() holds the GIL throughout, a
    pause as long as the whole call)."""
    import json
    import random
    import time

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = random.Random(1)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(2, 9))) for _ in range(3000)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [" ".join(rng.choice(words) for _ in range(50)) for _ in range(2000)]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|im_end|>"]))
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    tok = ModelTokenizer(str(tmp_path))
    text = " ".join(rng.choice(words) for _ in range(8000))  # ~50 KB
    done = threading.Event()
    spans: list[float] = []

    def work() -> None:
        for _ in range(20):
            t0 = time.perf_counter()
            tok.encode(text, True, release=True)
            spans.append(time.perf_counter() - t0)
        done.set()

    th = threading.Thread(target=work)
    th.start()
    longest, last = 0.0, time.perf_counter()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    th.join()
    mean = sum(spans) / len(spans)
    assert longest < mean * 0.6, (longest, mean)
