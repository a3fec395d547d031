"""Exact tokens: the model's tokenizer and chat template in the router (``--tokenizer-path``).

Without a tokenizer every token count the router balances by is an estimate (4 bytes a token)
and a text or chat prompt cannot be matched against the token ids the engines report in their
KV events. With one (a local directory holding ``tokenizer.json``, read by HuggingFace's Rust
``tokenizers``, and ``tokenizer_config.json`` with the chat template and special tokens;
``chat_template.jinja`` beside them wins over the config's template, ``--chat-template FILE``
over both), an inference request's prompt is tokenized before its pick:

* ``/generate`` ``text`` and ``/v1/completions`` ``prompt`` (a string, or a batch's first) are
  encoded with the tokenizer's special tokens (as SGLang encodes a text prompt); ``input_ids``
  are taken as they are;
* a chat request's messages are rendered with the template in a sandboxed jinja2 environment,
  with the variables a HuggingFace ``apply_chat_template`` gives it (``messages``, ``tools``,
  ``add_generation_prompt``, the special tokens, ``raise_exception``, ``strftime_now``), and the
  rendered text encoded without adding special tokens again.

The ids become ``RequestMeta.token_ids`` (the precise prefix index reads them) and their count
``input_tokens`` (demand, KV fit, prefill demand, the token rate limit). The body sent to the
worker is never changed. Only the operator's files are templates: nothing in a request is.

Cost: a prompt of up to ``INLINE_BYTES`` is tokenized on the event loop (a few tens of
microseconds); a longer one in a thread pool (the Rust tokenizer releases the GIL), and the
request waits at most ``--tokenize-timeout-ms`` for it: past that, or when a template fails to
render or the tokenizer fails, the estimate stands (counted by reason, logged once per reason).
Two caches keep repeated work cheap: L0, whole rendered prompts (``--tokenizer-cache-enable-l0``,
entries and bytes bounded), and L1, the ids of a prompt up to its last special token (a chat's
earlier turns), reused by the next prompt that extends it (``--tokenizer-cache-enable-l1``,
bytes bounded). Splitting at a special token cannot change the ids: the tokenizer cuts its
input at added tokens before anything else.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger("fastroute.tokenize")

# Prompts up to this many bytes are tokenized inline, on the event loop.
INLINE_BYTES = 4096
THREADS = 2
REASONS = ("timeout", "template", "tokenizer", "shape")


class TokenizerError(ValueError):
    """A tokenizer directory or template that cannot be used (names the file)."""


def _token_text(v: Any) -> str | None:
    """A special token of tokenizer_config.json: a string or an AddedToken object."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


class ModelTokenizer:
    """One model's tokenizer and chat template (module docstring)."""

    def __init__(self, path: str, chat_template: str | None = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:  # pragma: no cover - a dependency of the package
            raise TokenizerError(f"--tokenizer-path needs the tokenizers package: {exc}") from None
        if not os.path.isdir(path):
            raise TokenizerError(f"{path}: not a directory (give a local tokenizer directory; nothing is fetched)")
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise TokenizerError(f"{tok_file}: missing (fastroute reads tokenizer.json, the tokenizers format)")
        try:
            self.tokenizer = Tokenizer.from_file(tok_file)
        except Exception as exc:
            raise TokenizerError(f"{tok_file}: not a usable tokenizer ({exc})") from None
        self.path = path
        config: dict[str, Any] = {}
        cfg_file = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(cfg_file):
            try:
                with open(cfg_file, encoding="utf-8") as fh:
                    config = json.load(fh)
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{cfg_file}: not JSON ({exc})") from None
            if not isinstance(config, dict):
                raise TokenizerError(f"{cfg_file}: not a JSON object")
        self.special = {
            k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token") if (t := _token_text(config.get(k)))
        }
        source, template = self._template_source(path, config, chat_template)
        self.template_source = source
        self._template: Any = None
        if template is not None:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
            try:
                self._template = env.from_string(template)
            except TemplateError as exc:
                raise TokenizerError(f"{source}: the chat template does not compile ({exc})") from None
        # The added tokens flagged special: the places where L1 may cut a prompt, provided that
        # cutting there gives the same ids (a tokenizer that marks the start of its input, like
        # a Metaspace "first" prepend, does not: then L1 stays off for it).
        specials = tuple(
            t.content for t in self.tokenizer.get_added_tokens_decoder().values() if getattr(t, "special", False)
        )
        self.boundaries = specials if specials and self._splits_at(specials[0]) else ()

    def _splits_at(self, special: str) -> bool:
        probe = f"ab {special}cd ef{special} g"
        cut = probe.index(special) + len(special)
        enc = self.tokenizer.encode
        whole = enc(probe, add_special_tokens=False).ids
        return whole == enc(probe[:cut], add_special_tokens=False).ids + enc(probe[cut:], add_special_tokens=False).ids

    @staticmethod
    def _template_source(path: str, config: dict, override: str | None) -> tuple[str, str | None]:
        if override is not None:
            try:
                with open(override, encoding="utf-8") as fh:
                    text = fh.read()
            except OSError as exc:
                raise TokenizerError(f"{override}: cannot be read ({exc.strerror})") from None
            if not text.strip():
                raise TokenizerError(f"{override}: the chat template is empty")
            return override, text
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as fh:
                return jinja, fh.read()
        t = config.get("chat_template")
        if isinstance(t, list):  # named templates: the default one
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        return os.path.join(path, "tokenizer_config.json"), t if isinstance(t, str) else None

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def render(self, messages: list, tools: Any = None, kwargs: dict | None = None) -> str:
        """The chat prompt the engine renders for these messages (add_generation_prompt on)."""
        if self._template is None:
            raise _Fallback("template", "the tokenizer has no chat template")
        variables: dict[str, Any] = {**self.special, "add_generation_prompt": True}
        if kwargs:
            variables.update({k: v for k, v in kwargs.items() if isinstance(k, str)})
        variables["messages"] = messages
        if tools is not None:
            variables["tools"] = tools
        try:
            return self._template.render(**variables)
        except Exception as exc:  # a template error, or one the template raised itself
            raise _Fallback("template", f"{type(exc).__name__}: {exc}") from None

    def encode(self, text: str, special: bool, release: bool = False) -> list[int]:
        """The ids of ``text``; ``release``: through ``encode_batch``, which lets go of the GIL
        while the Rust code runs (``encode`` holds it: a 48 KB prompt stalled the event loop
        12 ms), for the pool's threads."""
        try:
            if release:
                return self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids
            return self.tokenizer.encode(text, add_special_tokens=special).ids
        except Exception as exc:
            raise _Fallback("tokenizer", f"{type(exc).__name__}: {exc}") from None


class _Fallback(Exception):
    """The estimate stands for this request (reason, detail)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _raise(message: str) -> None:
    raise _Fallback("template", f"the template raised: {message}")


class _Cache:
    """An LRU of text -> ids bounded by entries and by approximate bytes; the loop and the pool's
    threads share it, so every operation holds its lock."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self._lock = threading.Lock()
        self._d: OrderedDict[str, list[int]] = OrderedDict()
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _size(text: str, ids: list[int]) -> int:
        return len(text) + 8 * len(ids) + 120

    def peek(self, text: str) -> list[int] | None:
        with self._lock:
            ids = self._d.get(text)
            if ids is not None:
                self._d.move_to_end(text)
            return ids

    def get(self, text: str) -> list[int] | None:
        with self._lock:
            ids = self._d.get(text)
            if ids is None:
                self.misses += 1
                return None
            self._d.move_to_end(text)
            self.hits += 1
            return ids

    def count_hit(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def put(self, text: str, ids: list[int]) -> None:
        size = self._size(text, ids)
        with self._lock:
            if size > self.max_bytes or text in self._d:
                return
            self._d[text] = ids
            self.bytes += size
            while len(self._d) > self.max_entries or self.bytes > self.max_bytes:
                old, old_ids = self._d.popitem(last=False)
                self.bytes -= self._size(old, old_ids)

    def __len__(self) -> int:
        return len(self._d)


class Tokens:
    """The router's tokenizers by model, the caches, the thread pool and the counters."""

    def __init__(
        self,
        tokenizers: dict[str | None, ModelTokenizer],
        timeout_ms: float,
        l0: tuple[bool, int, int] = (False, 10_000, 256 << 20),
        l1: tuple[bool, int] = (False, 50 << 20),
    ) -> None:
        self.tokenizers = tokenizers
        self.timeout = max(float(timeout_ms), 0.0) / 1000.0
        self.l0 = _Cache(l0[1], l0[2]) if l0[0] else None
        self.l1 = _Cache(1 << 30, l1[1]) if l1[0] else None
        self._pool: ThreadPoolExecutor | None = None
        # requests tokenized exactly (inline / in the pool), and estimates kept by reason; with
        # metrics on, the same counts go to the process's Stats (fastroute_tokenized_requests)
        self.exact = {"inline": 0, "pool": 0}
        self.fallbacks = dict.fromkeys(REASONS, 0)
        self.counts: dict[str, int] | None = None
        self._said: set[str] = set()

    def for_model(self, model: Any) -> ModelTokenizer | None:
        tok = self.tokenizers.get(model) if isinstance(model, str) else None
        return tok if tok is not None else self.tokenizers.get(None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- what to tokenize ----------------------------------------------------------------------
    def job(self, tok: ModelTokenizer, path: str, obj: Any) -> tuple[str, bool, int] | None:
        """(text to encode, add special tokens, its size) for a request, or None when it has
        nothing to tokenize (input_ids, or a shape the router does not read)."""
        if path == "/v1/chat/completions":
            msgs = obj.get("messages")
            if type(msgs) is not list:
                return None
            kwargs = obj.get("chat_template_kwargs")
            text = tok.render(msgs, obj.get("tools"), kwargs if isinstance(kwargs, dict) else None)
            return text, False, len(text)
        value = obj.get("prompt") if path == "/v1/completions" else obj.get("text")
        if path == "/generate" and obj.get("input_ids") is not None:
            return None
        if type(value) is list and value and type(value[0]) is str:
            value = value[0]  # a batch: its first prompt (as the pick reads it)
        if type(value) is not str:
            return None
        return value, True, len(value)

    # ---- encoding with the caches ----------------------------------------------------------------
    def encode(self, tok: ModelTokenizer, text: str, special: bool, release: bool = False) -> list[int]:
        l0 = self.l0
        if l0 is not None:
            got = l0.get(text)
            if got is not None:
                return got
        ids = self._encode_l1(tok, text, special, release)
        if l0 is not None:
            l0.put(text, ids)
        return ids

    def _encode_l1(self, tok: ModelTokenizer, text: str, special: bool, release: bool) -> list[int]:
        l1 = self.l1
        if l1 is None or special or not tok.boundaries:
            return tok.encode(text, special, release)
        cuts = sorted({i + len(b) for b in tok.boundaries for i in _find_all(text, b)}, reverse=True)
        if not cuts:
            return tok.encode(text, False, release)
        last = cuts[0]
        head = None
        for cut in cuts:
            head = l1.peek(text[:cut])
            if head is not None:
                l1.count_hit(True)
                if cut < last:  # extend the cached head to this prompt's last special token
                    head = head + tok.encode(text[cut:last], False, release)
                    l1.put(text[:last], head)
                break
        else:
            l1.count_hit(False)
            head = tok.encode(text[:last], False, release)
            l1.put(text[:last], head)
        return head + tok.encode(text[last:], False, release) if last < len(text) else head

    # ---- one request ---------------------------------------------------------------------------------
    def start(self, meta: Any, path: str, loop: Any, then: Callable[[], None]) -> bool:
        """Tokenize ``meta``'s prompt; True when done now (``then`` not called), False when the
        pool works on it and ``then()`` follows on the loop (after the result or the timeout)."""
        tok = self.for_model(meta.model)
        if tok is None:
            return True
        try:
            job = self.job(tok, path, meta.obj)
        except _Fallback as fb:
            self._fallback(fb)
            return True
        if job is None:
            return True
        text, special, size = job
        if size <= INLINE_BYTES or self.timeout <= 0:
            try:
                self._set(meta, self.encode(tok, text, special))
                self._exact("inline")
            except _Fallback as fb:
                self._fallback(fb)
            return True
        if self._pool is None:
            self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="fastroute-tokenize")
        fut = loop.run_in_executor(self._pool, self.encode, tok, text, special, True)
        state = {"done": False}

        def finish(ids: list[int] | None, fb: _Fallback | None) -> None:
            if state["done"]:
                return
            state["done"] = True
            timer.cancel()
            if ids is not None:
                self._set(meta, ids)
                self._exact("pool")
            elif fb is not None:
                self._fallback(fb)
            then()

        def landed(f: Any) -> None:
            if state["done"] or f.cancelled():
                return
            exc = f.exception()
            if exc is None:
                finish(f.result(), None)
            else:
                finish(None, exc if isinstance(exc, _Fallback) else _Fallback("tokenizer", str(exc)))

        timer = loop.call_later(self.timeout, finish, None, _Fallback("timeout", f"over {self.timeout * 1000:g} ms"))
        fut.add_done_callback(landed)
        return False

    @staticmethod
    def _set(meta: Any, ids: list[int]) -> None:
        meta.token_ids = ids
        if meta.batch is None:  # a batch's count is its items' sum: the estimate stays
            meta.input_tokens = len(ids)

    def _exact(self, how: str) -> None:
        self.exact[how] += 1
        if self.counts is not None:
            self.counts[how] = self.counts.get(how, 0) + 1

    def _fallback(self, fb: _Fallback) -> None:
        self.fallbacks[fb.reason] = self.fallbacks.get(fb.reason, 0) + 1
        if self.counts is not None:
            self.counts[fb.reason] = self.counts.get(fb.reason, 0) + 1
        if fb.reason not in self._said:
            self._said.add(fb.reason)
            log.warning(
                "tokenizing a request failed (%s: %s): its token estimate is used (said once per reason)", fb.reason, fb
            )


def _find_all(text: str, sub: str) -> list[int]:
    out = []
    i = text.find(sub)
    while i >= 0:
        out.append(i)
        i = text.find(sub, i + 1)
    return out


def load(config: Any) -> Tokens | None:
    """The router's Tokens from its Config, or None without ``--tokenizer-path``/``--model-path``;
    raises TokenizerError naming the file that cannot be used."""
    specs = list(config.tokenizer_path or ())
    if not specs and config.model_path:
        specs = [config.model_path]
    if not specs:
        return None
    toks: dict[str | None, ModelTokenizer] = {}
    for spec in specs:
        model, sep, path = spec.partition("=")
        key: str | None = model if sep and not os.path.isdir(spec) else None
        if key is None:
            path = spec
        if key in toks:
            raise TokenizerError(f"--tokenizer-path: {'model ' + key if key else 'the default'} is given twice")
        toks[key] = ModelTokenizer(path, config.chat_template)
    l0 = (
        bool(config.tokenizer_cache_enable_l0),
        int(config.tokenizer_cache_l0_max_entries),
        int(config.tokenizer_cache_l0_max_memory),
    )
    l1 = (bool(config.tokenizer_cache_enable_l1), int(config.tokenizer_cache_l1_max_memory))
    for key, t in toks.items():
        log.info(
            "tokenizer for %s: %s (chat template: %s)",
            key or "every model",
            t.path,
            t.template_source if t.has_template else "none: chat requests keep the estimate",
        )
    return Tokens(toks, float(config.tokenize_timeout_ms), l0, l1)
