"""The simulated prefill rank's prefix cache: chained token-block hashes, leaf-first LRU eviction
and the events it reports (decoded from the bytes the publisher would send)."""

from __future__ import annotations

import msgspec
import pytest

from fastroute.sim.prefixcache import PrefixCache, token_block_hashes


def wire(events: list) -> list:
    return msgspec.msgpack.decode(msgspec.msgpack.encode(events))


def test_token_block_hashes_chain_and_ignore_the_partial_tail():
    a = token_block_hashes(list(range(10)), 4)
    b = token_block_hashes(list(range(8)) + [99, 98, 97, 96], 4)
    assert len(a) == 2 and len(b) == 3 and a == b[:2]
    # A block's hash names its whole prefix: the same tokens after another block differ.
    assert token_block_hashes([9, 9, 9, 9] + list(range(4, 8)), 4)[1] != a[1]
    with pytest.raises(ValueError, match="input_ids must be integers"):
        token_block_hashes([1, "2"], 4)  # type: ignore[list-item]


def test_shared_prefix_survives_eviction_of_the_leaves():
    got: list = []
    c = PrefixCache(4, 2)
    c.sink = lambda ev: got.append(wire(ev))
    ids = [1, 2, 3, 4, 5, 6]
    root = token_block_hashes(ids, 2)  # 3 blocks
    assert c.insert(root, ids) == 0
    other = token_block_hashes([1, 2, 3, 4, 7, 8], 2)  # shares 2 blocks, then branches
    assert c.insert(other, [1, 2, 3, 4, 7, 8]) == 2
    assert got[-1] == [
        {
            "type": "BlockStored",
            "block_hashes": [other[2]],
            "parent_block_hash": other[1],
            "token_ids": [7, 8],
            "block_size": 2,
            "lora_id": None,
            "medium": "GPU",
        }
    ]
    # A fresh 2-block chain needs 2 slots: the two leaves go, the shared prefix stays.
    fresh = token_block_hashes([50, 51, 52, 53], 2)
    c.insert(fresh, [50, 51, 52, 53])
    assert got[-1][0] == {"type": "BlockRemoved", "block_hashes": [root[2], other[2]], "medium": "GPU"}
    assert root[0] in c and root[1] in c and root[2] not in c
    # A chain longer than the cache is cached up to its capacity.
    c.clear()
    assert got[-1] == [{"type": "AllBlocksCleared"}] and len(c) == 0
    long = token_block_hashes(list(range(20)), 2)
    c.insert(long, list(range(20)))
    assert len(c) == 4 and got[-1][0]["block_hashes"] == list(long[:4])
    assert got[-1][0]["token_ids"] == list(range(8))
