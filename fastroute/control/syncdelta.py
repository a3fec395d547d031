"""Replica sync in proportion to what changed (``--replica-sync``; see control/replica.py).

A full payload per replica per tick made every replica decode every peer's every busy target
each tick: replicas x targets of Python per replica (5.1 ms a tick at 512 targets x 8
replicas, ``bench/fleet_scale.py --only sync``). Here a tick sends only what changed since this
replica's last tick: the script appends it to one Redis stream, numbered per replica (``seq``),
and applies it to this replica's full state, a Redis hash per replica
(``fastroute:{replicas}:rows:<id>``, name -> ``requests\ttokens\topen``), so the full state is
never sent by the replica (only after a reset, as a delta that replaces the hash). A reader that
knows a peer applies only the peer's new entries, and reads the peer's hash whole (joined into
payload lines by the script) when it does not know the peer yet, when a number is missing
(trimmed, oversize, Redis restarted) or when the peer has no number (an entry written by hand in
``fastroute:{replicas}:load``, read whole every tick). Lines are absolute values (``name,
requests, tokens, open``; zeros for a target that fell idle), so applying one twice changes
nothing. Everything stays one script call, one round trip, per tick.

:class:`Published` finds this replica's changes and writes their lines in one compiled pass
over its rows (``_ledger.sync_encode``; a copy of the rows and NumPy per name when a name has
two rows); :class:`View` holds what each peer published in one array (local name x peer slot
x requests/tokens/open: a name's sum reads adjacent cells), decoded by compiled code
(``_ledger.sync_decode``), and stores the sums of the names that changed into the table
(``_ledger.sync_store``): no Python per line or per row on a tick.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastroute.core import _ledger
from fastroute.core.table import CIRCUIT_OPEN, COL_CIRCUIT, COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_OTHERS_EST

LOG_KEY = "fastroute:{replicas}:log"
SEQ_KEY = "fastroute:{replicas}:seq"
ROWS_PREFIX = "fastroute:{replicas}:rows:"

# KEYS: beat, load (entries written by hand only), owner, log, seq, this replica's rows hash.
# ARGV: id, rows key prefix, ttl ms, nonce, max entry bytes, delta, cursor (last stream id read,
# '0-0' none), known peer ids (newline-joined), the step of this replica's entry number: 0
# appends nothing (no change), 1 the delta, 2 after a reset (the delta is the whole state and
# replaces the hash; even an empty one: its followers miss a number and read it whole), the
# wake channel (a changing tick publishes this replica's id there: control/syncpace.py), 1 to
# renew the keys' expiry (ten TTLs: the replica asks at least once a TTL, not every tick).
# Returns {repaired, previous nonce, cursor, live count, lost (1: this replica's state in Redis
# is gone or was repaired, publish it whole again), (id, seq, kind, value) per live
# replica..., (id, seq, kind, value) per new stream entry of a known peer...}; kind 0: nothing
# sent (a known peer), 1: its payload / delta, 2: its length (over the cap, not sent).
TICK = """
local repaired, lost = 0, 0
for i, want in ipairs({'zset', 'hash', 'hash', 'stream', 'hash', 'hash'}) do
  local got = redis.call('TYPE', KEYS[i]).ok
  if got ~= want and got ~= 'none' then
    redis.call('DEL', KEYS[i])
    repaired = repaired + 1
    if i >= 5 then lost = 1 end
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
local cap = tonumber(ARGV[5])
local step = tonumber(ARGV[9])
local prev = redis.call('HGET', KEYS[3], ARGV[1])
if step ~= 2 and not redis.call('HGET', KEYS[5], ARGV[1]) then lost = 1 end
redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[4])
if step > 0 then
  if step == 2 then redis.call('DEL', KEYS[6]) end
  local set, del = {}, {}
  for name, v in string.gmatch(ARGV[6], '([^\\t\\n]*)\\t([^\\n]*)\\n') do
    if v == '0\\t0\\t0' then del[#del + 1] = name else set[#set + 1] = name; set[#set + 1] = v end
    if #set >= 1000 then redis.call('HSET', KEYS[6], unpack(set)); set = {} end
    if #del >= 1000 then redis.call('HDEL', KEYS[6], unpack(del)); del = {} end
  end
  if #set > 0 then redis.call('HSET', KEYS[6], unpack(set)) end
  if #del > 0 then redis.call('HDEL', KEYS[6], unpack(del)) end
  local seq = redis.call('HINCRBY', KEYS[5], ARGV[1], step)
  redis.call('XADD', KEYS[4], 'MINID', '~', tostring(now - 3 * ttl), '*', 'i', ARGV[1], 's', seq, 'd', ARGV[6])
  redis.call('PUBLISH', ARGV[10], ARGV[1])
end
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
if #dead > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
  redis.call('HDEL', KEYS[2], unpack(dead))
  redis.call('HDEL', KEYS[3], unpack(dead))
  redis.call('HDEL', KEYS[5], unpack(dead))
  local gone = {}
  for i, id in ipairs(dead) do gone[i] = ARGV[2] .. id end
  redis.call('DEL', unpack(gone))
end
if ARGV[11] == '1' then
  for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl * 10) end
end
local known = {}
for id in string.gmatch(ARGV[8], '[^\\n]+') do known[id] = true end
local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)
local live = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. (now - ttl), '+inf')
local out = {repaired, prev, (#last > 0) and last[1][1] or ARGV[7], #live, lost}
local seqs = redis.call('HMGET', KEYS[5], unpack(live))
for i, id in ipairs(live) do
  local seq = seqs[i] or ''
  out[#out + 1] = id
  out[#out + 1] = seq
  if id == ARGV[1] or (known[id] and seq ~= '') then
    out[#out + 1] = 0
    out[#out + 1] = ''
  elseif seq == '' then
    local n = redis.call('HSTRLEN', KEYS[2], id)
    if n > cap then
      out[#out + 1] = 2
      out[#out + 1] = n
    else
      out[#out + 1] = 1
      out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
    end
  else
    local rows = ARGV[2] .. id
    local n = (redis.call('TYPE', rows).ok == 'hash') and redis.call('HLEN', rows) or 0
    local body = ''
    if n * 8 <= cap and n > 0 then
      local h = redis.call('HGETALL', rows)
      local lines = {}
      for i = 1, #h, 2 do lines[#lines + 1] = h[i] .. '\\t' .. h[i + 1] .. '\\n' end
      body = table.concat(lines)
    elseif n == 0 and redis.call('HSTRLEN', KEYS[2], id) <= cap then
      -- a replica of the version before (its whole payload in the load hash), mid-upgrade
      body = redis.call('HGET', KEYS[2], id) or ''
    end
    if n * 8 > cap or #body > cap then
      out[#out + 1] = 2
      out[#out + 1] = math.max(#body, n * 8)
    else
      out[#out + 1] = 1
      out[#out + 1] = body
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


# The columns a tick reads of its own rows: requests, tokens, circuit, the others' estimates.
SNAP_COLS = np.array([COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_CIRCUIT, COL_OTHERS_EST], np.int64)


def _line(name: str, v: list[int]) -> str:
    return f"{name}\t{v[0]}\t{v[1]}\t{v[2]}\n"


class Names:
    """This host's target names: an index per name (local to this host), the table rows of
    each (rows of one name are summed: a removed worker's row that still drains counts until
    its last lease ends), rebuilt when the registry changes."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.names: list[str] = []
        self.index = _ledger.NameIndex(())  # name (UTF-8) -> its position in names
        self.rows: dict[str, list[int]] = {}
        self.end = 0  # one past the last row in use
        self.row_ids = np.zeros(0, np.int64)  # rows in use
        self.row_name = np.zeros(0, np.int64)  # the name index of each of those rows
        self.single: np.ndarray | None = None  # the row of each name when every name has one
        self.starts = np.zeros(1, np.int64)  # rows of name i: by_name[starts[i]:starts[i + 1]]
        self.by_name = np.zeros(0, np.int64)

    def refresh(self, table: Any, registry: Any) -> bool:
        """Rebuild when the target set changed; True when it did."""
        info = registry.target_info
        key = (table.generation, len(info))
        if key == self.key:
            return False
        self.key = key
        rows: dict[str, list[int]] = {}
        for t, i in enumerate(info):
            if i is not None and t < table.capacity:
                rows.setdefault(registry.target_name(t), []).append(t)
        self.rows = rows
        self.names = list(rows)
        self.index = _ledger.NameIndex(name.encode() for name in self.names)
        pairs = [(t, i) for i, ts in enumerate(rows.values()) for t in ts]
        self.row_ids = np.array([t for t, _ in pairs], np.int64)
        self.row_name = np.array([i for _, i in pairs], np.int64)
        self.end = int(self.row_ids.max()) + 1 if pairs else 0
        self.single = self.row_ids.copy() if len(pairs) == len(rows) else None
        self.starts = np.zeros(len(rows) + 1, np.int64)
        self.starts[1:] = np.cumsum([len(ts) for ts in rows.values()])
        self.by_name = self.row_ids.copy()  # pairs are grouped by name already
        return True


class Published:
    """This replica's side: what it published per name, and the lines that changed since."""

    def __init__(self) -> None:
        self._vals: np.ndarray | None = None  # (names, 3) last published: requests, tokens, open
        self._names: list[str] = []  # the names those rows stand for
        self.held: list[int] = []  # rows holding an estimate of the others' placements
        self._out = np.zeros(0, np.uint8)  # the compiled encoder's buffer, kept between ticks
        # A new publisher does not know what its followers or its hash hold (a tick failed
        # half-way, or this is the first): its first entry is its whole state, replaces its
        # hash and skips a number, so they read it whole.
        self.reset = True

    def update(self, table: Any, names: Names) -> bytes:
        """The delta since the last call (the whole state after a reset)."""
        old, old_names = self._vals, self._names
        self.held = []
        if names.single is not None and old is not None and old_names is names.names:
            # the common tick: one compiled pass over the rows finds and writes the changed lines
            args = (table.array, names.single, old, self.held, names.index.utf8, names.index.at)
            out = _ledger.sync_encode(*args, self._out, self.reset)
            if out is None:  # the names grew since the buffer was sized
                self._out = np.zeros(len(names.index.utf8) + 64 * len(names.names), np.uint8)
                out = _ledger.sync_encode(*args, self._out, self.reset)
            assert out is not None  # (sized for every name)
            return out
        snap = _ledger.snapshot_cols(table.array, names.end, SNAP_COLS)
        self.held = np.flatnonzero(snap[:, 3]).tolist()  # SNAP_COLS: the others' estimates
        rows = snap[names.single] if names.single is not None else snap[names.row_ids]
        mine = rows[:, :3].copy()
        mine[:, 2] = mine[:, 2] == CIRCUIT_OPEN
        if names.single is not None:
            cur = mine
        else:
            cur = np.zeros((len(names.names), 3), np.int64)
            np.add.at(cur, names.row_name, mine)
            np.minimum(cur[:, 2], 1, out=cur[:, 2])
        self._vals, self._names = cur, names.names
        if self.reset:
            at = _nonzero(cur)
            return "".join(_line(names.names[i], v) for i, v in zip(at, cur[at].tolist())).encode()
        if old is not None and old_names is names.names:
            at = np.flatnonzero((cur != old).any(axis=1)).tolist()
            return "".join(_line(names.names[i], v) for i, v in zip(at, cur[at].tolist())).encode()
        # the names changed: compare by name (absent means zero)
        before = (
            {old_names[i]: v for i, v in zip(_nonzero(old), old[_nonzero(old)].tolist())} if old is not None else {}
        )
        now = {names.names[i]: v for i, v in zip(_nonzero(cur), cur[_nonzero(cur)].tolist())}
        zero = [0, 0, 0]
        return "".join(
            _line(name, now.get(name, zero))
            for name in {**before, **now}
            if now.get(name, zero) != before.get(name, zero)
        ).encode()


def _nonzero(a: np.ndarray) -> list[int]:
    return np.flatnonzero(a.any(axis=1)).tolist()


class View:
    """What each known peer published, per local name, in one array (name x peer slot x
    requests/tokens/open); ``touched`` collects the names whose sums may have changed since
    the caller last stored them."""

    def __init__(self, names: Names) -> None:
        self.names = names
        self.seq: dict[bytes, int] = {}  # last entry applied per followed peer
        self.slot: dict[bytes, int] = {}  # the vals slot of each peer read
        self.vals = np.zeros((len(names.names), 8, 3), np.int64)  # a name's peers side by side
        self._free = list(range(7, -1, -1))
        self.mark = np.zeros(len(names.names), np.uint8)
        self.touched: list[int] = []
        self.cursor = b"0-0"
        self.full = True  # a new view: the first store writes every row (absent names zeroed)

    def known(self) -> bytes:
        """The peers this view follows entry by entry (the others are read whole)."""
        return b"\n".join(self.seq)

    def forget(self, peer: bytes) -> None:
        """Drop a peer (gone, or to be read whole again)."""
        self.seq.pop(peer, None)
        slot = self.slot.pop(peer, None)
        if slot is not None:
            self._zero(slot)
            self._free.append(slot)

    def _zero(self, slot: int) -> None:
        for i in np.flatnonzero(self.vals[:, slot].any(axis=1)).tolist():
            if not self.mark[i]:
                self.mark[i] = 1
                self.touched.append(i)
        self.vals[:, slot] = 0

    def _slot(self, peer: bytes) -> int:
        slot = self.slot.get(peer)
        if slot is None:
            if not self._free:
                n = self.vals.shape[1]
                self.vals = np.concatenate((self.vals, np.zeros_like(self.vals)), axis=1)
                self._free = list(range(2 * n - 1, n - 1, -1))
            slot = self.slot[peer] = self._free.pop()
        return slot

    def set_all(self, peer: bytes, payload: bytes, limit: int) -> tuple[int, int]:
        """Replace everything a peer published by its whole payload; (good, bad) lines."""
        slot = self._slot(peer)
        self._zero(slot)
        got = _ledger.sync_decode(payload, self.names.index, self.vals, slot, self.mark, self.touched, True, limit)
        self._release_if_empty(peer, slot)
        return got

    def set_lines(self, peer: bytes, delta: bytes, limit: int) -> tuple[int, int]:
        """Apply a peer's changed names (absolute values; zeros: idle now); (good, bad)."""
        new = peer not in self.slot
        slot = self._slot(peer)
        got = _ledger.sync_decode(delta, self.names.index, self.vals, slot, self.mark, self.touched, False, limit)
        if new:
            self._release_if_empty(peer, slot)
        return got

    def follow(self, reply: list, start: int, whole: set[bytes], limit: int, max_bytes: int) -> list[tuple]:
        """Apply the new entries of the peers this view follows (``reply[start:]``, an (id,
        number, kind, value) each): the next entry of a peer holding a slot in one compiled
        call (``_ledger.sync_entries``), the rest here in order (a missing number or an
        oversize entry: the peer is read whole next tick). Returns what was skipped, as
        (what, why, count) for the caller to count and log."""
        rest, bad, who = _ledger.sync_entries(
            reply, start, self.seq, self.slot, whole, self.names.index, self.vals, self.mark, self.touched, limit
        )
        skips = [("bad_line", f"replica {who!r} sent {bad} malformed or out-of-range line(s)", bad)] if bad else []
        for i in rest:
            pid, seq, kind, value = reply[i : i + 4]
            last = self.seq.get(pid)
            if pid in whole or last is None:
                continue
            n = int(seq)
            if n <= last:
                continue
            if kind == 2 or n != last + 1:  # oversize, or an entry missing: read it whole next tick
                if kind == 2:
                    skips.append(("oversize", f"replica {pid!r} has a {value}-byte entry (limit {max_bytes})", 1))
                del self.seq[pid]
                continue
            _, bad = self.set_lines(pid, value, limit)
            if bad:
                skips.append(("bad_line", f"replica {pid!r} sent {bad} malformed or out-of-range line(s)", bad))
            self.seq[pid] = n
        return skips

    def _release_if_empty(self, peer: bytes, slot: int) -> None:
        # A peer with nothing on this host's names holds no slot: peers that only write names
        # unknown here (or a flood of fake ones) cost no (names x 3) array each.
        if not self.vals[:, slot].any():
            del self.slot[peer]
            self._free.append(slot)

    def store(self, table: Any, limit: int) -> list[int]:
        """Store the sums of the touched names (every name on a new view) into the table's
        others columns; returns the names stored."""
        names = list(range(len(self.names.names))) if self.full else self.touched
        self.full = False
        if names:
            _ledger.sync_store(
                table.array,
                table.header,
                self.vals,
                np.fromiter(self.slot.values(), np.int64, len(self.slot)),
                np.array(names, np.int64),
                self.names.starts,
                self.names.by_name,
                limit,
            )
        if self.touched:
            self.mark.fill(0)
            self.touched = []
        return names
