"""The prefix cache of one simulated prefill DP rank: an LRU of chained block hashes that behaves
like SGLang's paged radix cache, and reports what it stores and evicts as KV events.

Blocks: a prompt is cut into full blocks of ``prefix_block_tokens`` tokens (a partial tail is not
cached, as a paged cache keeps whole pages only). Block i's hash covers the whole prefix up to
it, so two prompts share a cached block only when they share everything before it too. A prompt
given as token ids (``/generate`` with ``input_ids``) is hashed by ``token_block_hashes``: a
signed 64-bit BLAKE2b of the previous block's hash and the block's token ids, so its hashes are
the int64 values SGLang publishes. A text prompt keeps the older byte-block hashes
(``block_hashes``) and is cached without events: the simulator has no tokenizer, and events with
made-up token ids would mislead a router.

Eviction is leaf first, like a radix tree's: a request touches its blocks deepest first, so a
block is always more recent than every block below it in the chain, and the least recently used
block is a leaf. A chain longer than the whole cache is cached up to the capacity.

Events (``sink(list)``, one call per cache operation): ``BlockRemoved`` with every evicted block
that was published, then one ``BlockStored`` with the newly stored blocks of the chain (their
token ids, and the hash of the block before them as ``parent_block_hash``, None at the root);
``clear`` gives ``AllBlocksCleared``.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from fastroute.sim.kvevents import AllBlocksCleared, BlockRemoved, BlockStored


def block_hashes(data: bytes, block_bytes: int) -> tuple:
    """Chained hashes of the full ``block_bytes`` blocks of a text prompt (Python's ``hash``:
    stable inside one process, which is all a text block needs)."""
    out = []
    h = 0
    for i in range(0, len(data) - block_bytes + 1, block_bytes):
        h = hash((h, data[i : i + block_bytes]))
        out.append(h)
    return tuple(out)


def token_block_hashes(ids: Sequence[int], block_tokens: int) -> tuple:
    """Chained signed int64 hashes of the full ``block_tokens`` blocks of a token id prompt.

    Raises ``ValueError`` when an id is not an integer in the signed 64-bit range."""
    try:
        raw = array("q", ids).tobytes()
    except (TypeError, OverflowError):
        raise ValueError("input_ids must be integers") from None
    step = 8 * block_tokens
    out = []
    prev = b"\0" * 8
    for i in range(0, len(raw) - step + 1, step):
        prev = hashlib.blake2b(prev + raw[i : i + step], digest_size=8).digest()
        out.append(int.from_bytes(prev, "big", signed=True))
    return tuple(out)


class PrefixCache:
    """One rank's cached blocks, least recently used first; ``sink`` receives its events."""

    __slots__ = ("_lru", "capacity", "block_tokens", "sink")

    def __init__(self, capacity_blocks: int, block_tokens: int) -> None:
        self._lru: OrderedDict[int, bool] = OrderedDict()  # hash -> published (token ids known)
        self.capacity = max(1, capacity_blocks)
        self.block_tokens = block_tokens
        self.sink: Callable[[list], None] | None = None

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: int) -> bool:
        return h in self._lru

    def match(self, blocks: Sequence[int]) -> int:
        """Leading blocks of ``blocks`` held now (a lookup: nothing is touched)."""
        n = 0
        lru = self._lru
        for h in blocks:
            if h not in lru:
                break
            n += 1
        return n

    def insert(self, blocks: Sequence[int], token_ids: Sequence[int] | None = None) -> int:
        """Look ``blocks`` up and cache them (most recent, deepest first); return the blocks
        that were already held. ``token_ids``: the prompt's ids, for the events (None: none)."""
        lru = self._lru
        chain = blocks[: self.capacity]
        hits = self.match(chain)
        missing = chain[hits:]
        for h in reversed(chain[:hits]):  # protect the hit blocks from the eviction below
            lru.move_to_end(h)
        removed = []
        for _ in range(len(lru) + len(missing) - self.capacity):
            h, published = lru.popitem(last=False)
            if published:
                removed.append(h)
        published = token_ids is not None
        for h in reversed(missing):
            lru[h] = published
        for h in reversed(chain[:hits]):  # a block stays more recent than its descendants
            lru.move_to_end(h)
        if self.sink is not None:
            events: list = []
            if removed:
                events.append(BlockRemoved(removed, "GPU"))
            if missing and token_ids is not None:
                bs = self.block_tokens
                parent = chain[hits - 1] if hits else None
                ids = list(token_ids[hits * bs : len(chain) * bs])
                events.append(BlockStored(list(missing), parent, ids, bs, None, "GPU"))
            if events:
                self.sink(events)
        return hits

    def clear(self) -> None:
        """Drop every block (a flush or a restart): ``AllBlocksCleared``."""
        self._lru.clear()
        if self.sink is not None:
            self.sink([AllBlocksCleared()])
