"""Replica sync in proportion to what changed (``--replica-sync``; see control/replica.py).

A full payload per replica per tick made every replica decode every peer's every busy target
each tick: replicas x targets of Python per replica (5.1 ms a tick at 512 targets x 8
replicas, ``bench/fleet_scale.py --only sync``). Here each tick still stores this replica's full
payload (a newcomer reads it once) but also appends what changed since its last tick to one
Redis stream, numbered per replica (``seq``); a reader that knows a peer applies only the
peer's new entries, and takes the full payload again when it does not know the peer yet, when
a number is missing (trimmed, oversize, Redis restarted) or when the peer has no number (an
entry written by hand). Lines are absolute values (``name, requests, tokens, open``; zeros
for a target that fell idle), so applying one twice changes nothing. Everything stays one
script call, one round trip, per tick.

:class:`Published` finds this replica's changes (a compiled copy of the table's rows and one
NumPy comparison, then Python only for the names that changed); :class:`View` holds what
each peer published and the sums per name, and reports the names whose sums changed.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastroute.core import _ledger
from fastroute.core.table import CIRCUIT_OPEN, COL_CIRCUIT, COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS

LOG_KEY = "fastroute:{replicas}:log"
SEQ_KEY = "fastroute:{replicas}:seq"

# KEYS: beat, load, owner, log, seq. ARGV: id, payload, ttl ms, nonce, max entry bytes, delta,
# cursor (last stream id read, '0-0' none), known peer ids (newline-joined), the step of this
# replica's entry number: 0 appends nothing (no change), 1 the delta, 2 after a reset (even
# an empty delta: its followers miss a number and read it whole).
# Returns {repaired, previous nonce, cursor, live count, (id, seq, kind, value) per live
# replica..., (id, seq, kind, value) per new stream entry of a known peer...}; kind 0: nothing
# sent (a known peer), 1: its payload / delta, 2: its length (over the cap, not sent).
TICK = """
local repaired = 0
for i, want in ipairs({'zset', 'hash', 'hash', 'stream', 'hash'}) do
  local got = redis.call('TYPE', KEYS[i]).ok
  if got ~= want and got ~= 'none' then
    redis.call('DEL', KEYS[i])
    repaired = repaired + 1
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local cap = tonumber(ARGV[5])
local prev = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
if tonumber(ARGV[9]) > 0 then
  local seq = redis.call('HINCRBY', KEYS[5], ARGV[1], tonumber(ARGV[9]))
  redis.call('XADD', KEYS[4], 'MINID', '~', tostring(now - 3 * ttl), '*', 'i', ARGV[1], 's', seq, 'd', ARGV[6])
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
  redis.call('HDEL', KEYS[2], unpack(dead))
  redis.call('HDEL', KEYS[3], unpack(dead))
  redis.call('HDEL', KEYS[5], unpack(dead))
end
for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl * 10) end
local known = {}
for id in string.gmatch(ARGV[8], '[^\\n]+') do known[id] = true end
local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
local out = {repaired, prev, (#last > 0) and last[1][1] or ARGV[7], 0}
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. (now - ttl), '+inf')
out[4] = #live
for _, id in ipairs(live) do
  local seq = redis.call('HGET', KEYS[5], id) or ''
  out[#out + 1] = id
  out[#out + 1] = seq
  if known[id] and seq ~= '' then
    out[#out + 1] = 0
    out[#out + 1] = ''
  else
    local n = redis.call('HSTRLEN', KEYS[2], id)
    if n > cap then
      out[#out + 1] = 2
      out[#out + 1] = n
    else
      out[#out + 1] = 1
      out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
    end
  end
end
if ARGV[7] ~= '0-0' then
  for _, e in ipairs(redis.call('XRANGE', KEYS[4], '(' .. ARGV[7], '+')) do
    local f = e[2]
    local id, seq, d = f[2], f[4], f[6]
    if id ~= ARGV[1] and known[id] then
      out[#out + 1] = id
      out[#out + 1] = seq
      if #d > cap then
        out[#out + 1] = 2
        out[#out + 1] = #d
      else
        out[#out + 1] = 1
        out[#out + 1] = d
      end
    end
  end
end
return out
"""

_ZERO = (0, 0, 0)


def _line(name: str, v: tuple[int, int, int]) -> str:
    return f"{name}\t{v[0]}\t{v[1]}\t{v[2]}\n"


class Names:
    """Table rows by target name (rows of one name are summed: a removed worker's row that
    still drains counts until its last lease ends), rebuilt when the registry changes."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.rows: dict[str, list[int]] = {}
        self.name_of: dict[int, str] = {}

    def refresh(self, table: Any, registry: Any) -> bool:
        """Rebuild when the target set changed; True when it did."""
        info = registry.target_info
        key = (table.generation, len(info))
        if key == self.key:
            return False
        self.key = key
        rows: dict[str, list[int]] = {}
        name_of: dict[int, str] = {}
        for t, i in enumerate(info):
            if i is None:
                continue
            name = registry.target_name(t)
            rows.setdefault(name, []).append(t)
            name_of[t] = name
        self.rows, self.name_of = rows, name_of
        return True


class Published:
    """This replica's side: its full payload (a line per busy name, kept per name) and the lines
    that changed since the last tick."""

    def __init__(self) -> None:
        self._vals: dict[str, tuple[int, int, int]] = {}
        self._lines: dict[str, str] = {}
        self._prev: np.ndarray | None = None  # (rows, 3) last seen: requests, tokens, open
        self.snap: np.ndarray | None = None  # the rows copied at the last update (all columns)
        # A new publisher does not know what its followers hold (a tick failed half-way, or
        # this is the first): its first entry skips a number, so they read it whole.
        self.reset = True

    def update(self, table: Any, names: Names, rebuilt: bool) -> tuple[bytes, bytes]:
        """(full payload, delta since the last call)."""
        n = min(len(names.name_of) and (max(names.name_of) + 1), table.capacity)
        snap = self.snap = _ledger.snapshot(table.array, n)
        cur = np.empty((n, 3), dtype=np.int64)
        cur[:, 0] = snap[:, COL_IN_FLIGHT]
        cur[:, 1] = snap[:, COL_IN_FLIGHT_TOKENS]
        cur[:, 2] = snap[:, COL_CIRCUIT] == CIRCUIT_OPEN
        prev = self._prev
        if rebuilt or prev is None or prev.shape != cur.shape:
            changed = set(names.rows) | set(self._vals)
        else:
            rows = np.flatnonzero((cur != prev).any(axis=1)).tolist()
            changed = {names.name_of[t] for t in rows if t in names.name_of}
        self._prev = cur
        delta = []
        for name in changed:
            r = k = o = 0
            for t in names.rows.get(name, ()):
                if t < n:
                    r += int(cur[t, 0])
                    k += int(cur[t, 1])
                    o |= int(cur[t, 2])
            v = (r, k, o)
            if v == self._vals.get(name, _ZERO):
                continue
            delta.append(_line(name, v))
            if v == _ZERO:
                self._vals.pop(name, None)
                self._lines.pop(name, None)
            else:
                self._vals[name] = v
                self._lines[name] = _line(name, v)
        return "".join(self._lines.values()).encode(), "".join(delta).encode()


class View:
    """What each known peer published (name -> requests, tokens, open) and the sums over
    peers; ``dirty`` collects the names whose sums changed since the caller last took them."""

    def __init__(self) -> None:
        self.peers: dict[bytes, dict[str, list[int]]] = {}
        self.seq: dict[bytes, int] = {}  # last entry applied per known peer
        self.sums: dict[str, list[int]] = {}
        self.dirty: set[str] = set()
        self.cursor = b"0-0"
        self.full = True  # a new view: the first store writes every row (absent names zeroed)

    def known(self) -> bytes:
        """The peers this view follows entry by entry (the others are read whole)."""
        return b"\n".join(self.seq)

    def forget(self, peer: bytes) -> None:
        """Drop a peer (gone, or to be read whole again)."""
        self.seq.pop(peer, None)
        self.set_all(peer, {})

    def set_all(self, peer: bytes, state: dict[str, list[int]]) -> None:
        """Replace everything a peer published."""
        old = self.peers.pop(peer, {})
        for name, v in old.items():
            self._add(name, v, -1)
        for name, v in state.items():
            self._add(name, v, 1)
        if state:
            self.peers[peer] = state

    def set_lines(self, peer: bytes, lines: dict[str, list[int]]) -> None:
        """Apply a peer's changed names (absolute values; zeros: idle now)."""
        state = self.peers.setdefault(peer, {})
        for name, v in lines.items():
            old = state.pop(name, None)
            if old is not None:
                self._add(name, old, -1)
            if v[0] or v[1] or v[2]:
                state[name] = v
                self._add(name, v, 1)

    def _add(self, name: str, v: list[int], sign: int) -> None:
        acc = self.sums.get(name)
        if acc is None:
            acc = self.sums[name] = [0, 0, 0]
        acc[0] += sign * v[0]
        acc[1] += sign * v[1]
        acc[2] += sign * (1 if v[2] else 0)
        if acc == [0, 0, 0]:
            del self.sums[name]
        self.dirty.add(name)
