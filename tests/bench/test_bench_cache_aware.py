"""cache_aware pick cost: 8 and 64 targets, 1 KB and 32 KB prompts, two workloads.

* ``chat``: 256 conversations over a shared system prompt, each request a conversation prefix
  plus one of 64 user turns; after warm-up nearly every pick is a cache hit whose walk covers the
  whole prompt and whose insert only refreshes LRU positions.
* ``unique``: every prompt new from its first bytes (a counter, then the same body), so each pick
  misses, hangs a new leaf of the prompt's size and, with ``max_tree_size`` at 1 MiB per target,
  evicts as much as it inserts: the steady state of a long run.

Run: python -m pytest tests/bench/test_bench_cache_aware.py --benchmark-only
(opt-in: tests/bench is outside the default testpaths).  The ``acquire`` rows go through the
Group (pick + book + release), the way the proxy calls it.
"""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from fastroute.core.cache_aware import CacheAwarePolicy
from fastroute.core.routing import Router
from fastroute.core.table import TargetTable
from tests.stubs import StubMeta

TARGETS = [8, 64]
SIZES = [1024, 32 * 1024]
CONFIG = SimpleNamespace(
    cache_threshold=0.3,
    balance_abs_threshold=64,
    balance_rel_threshold=1.5,
    eviction_interval_secs=60,
    max_tree_size=1 << 20,
    seed=1,
)


@pytest.fixture(scope="module")
def tab():
    t = TargetTable(128)
    for _ in range(128):
        t.alloc()
    yield t
    t.unlink()


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz     ,.") for _ in range(n))


def chat_prompts(size: int) -> list[str]:
    rng = random.Random(size)
    system = _text(rng, size // 4)
    convs = [system + _text(rng, size - size // 4 - 32) for _ in range(256)]
    turns = [_text(rng, 32) for _ in range(64)]
    return [convs[rng.randrange(256)] + turns[rng.randrange(64)] for _ in range(4096)]


def unique_prompts(size: int):
    body = _text(random.Random(size), size - 10)
    # Unique from byte 0: the counter comes first.  Building the string is part of the timing
    # (about 0.1 us per KB), as it would be in the proxy.
    return (f"{i:09d} " + body for i in itertools.count())


@pytest.mark.parametrize("size", SIZES, ids=["1KB", "32KB"])
@pytest.mark.parametrize("n", TARGETS)
@pytest.mark.parametrize("workload", ["chat", "unique"])
def test_pick(benchmark, tab, n, size, workload):
    benchmark.group = f"cache_aware-{workload}-{size // 1024}KB"
    ids = list(range(n))
    pol = CacheAwarePolicy(tab, CONFIG, seed=1)
    pol.set_targets(ids, [f"http://w{i}:8000" for i in ids])
    pick = pol.pick
    if workload == "chat":
        prompts = chat_prompts(size)
        for p in prompts:  # warm-up: the tree knows every conversation
            pick(p, ids)
        it = itertools.cycle(prompts)
    else:
        it = unique_prompts(size)
        for _ in range(2 * (1 << 20) * n // size):  # warm-up: fill the trees to the bound
            pick(next(it), ids)

    def once():
        pick(next(it), ids)

    benchmark(once)
    sizes = pol.tree.sizes()
    assert max(sizes.values()) <= CONFIG.max_tree_size
    if workload == "chat":
        assert pol.tree.hits > pol.tree.misses


@pytest.mark.parametrize("n", TARGETS)
def test_acquire_1kb_chat(benchmark, tab, n):
    benchmark.group = "cache_aware-acquire-1KB"
    ids = list(range(n))
    g = Router(tab, seed=1, config=CONFIG).group(ids, "cache_aware", names=[f"http://w{i}:8000" for i in ids])
    prompts = [StubMeta(p) for p in chat_prompts(1024)]
    for p in prompts:
        g.acquire(10, None, p).release()
    it = itertools.cycle(prompts)
    acquire = g.acquire

    def once():
        acquire(10, None, next(it)).release()

    benchmark(once)
    assert sum(tab.in_flight(t) for t in ids) == 0
