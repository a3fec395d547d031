"""The ledger: booking and releasing targets in the shared table, and the compiled picker.

A ``Lease`` is the only way a booking is undone: it holds the target row and the tokens it
added, and its ``release()`` subtracts them exactly once however often it is called.  A release
that finds the counter already at zero is not applied; it is counted in the table header
(``HDR_UNDERFLOWS``) because it means some path released a booking it did not own.

``Picker`` is the per-request entry point: one Python call runs the policy kernel and books the
winner, so the I/O layer never loops over targets in Python.
"""
cimport cython
from libc.stdint cimport int64_t, uint64_t
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memchr, memcmp, memcpy
from fastroute.core._atomic cimport fr_load_i64, fr_store_i64, fr_add_i64, fr_cas_i64
from fastroute.core._layout cimport (
    COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_PICKS, COL_POLLED_RUNNING, COL_POLLED_WAITING,
    COL_POLLED_TOKENS, COL_POLLED_AT, COL_POLLED_MAX_TOKENS, COL_TOKENS_AT_POLL, HDR_UNDERFLOWS,
    NCOLS, NHDR, COL_CIRCUIT, COL_CB_FAILS, CIRCUIT_CLOSED, CIRCUIT_OPEN, row_tokens, COL_OTHERS_EST,
    COL_OTHERS_EST_TOKENS, HDR_REPLICAS, HDR_REPLICA_SLOT, HDR_SYNC_TICKS, COL_POLLED_UNCACHED,
    COL_POLLED_KV_QUEUE, COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS, COL_OTHERS_OPEN, COL_ALLOCATED,
    HDR_FEED_ON, HDR_FEED_AT, feed_publish,
)
from fastroute.core._policy cimport (
    pick_round_robin, pick_random, pick_p2c, pick_demand, pick_ring, pick_kv_fit, kv_free,
    pick_coordinated, hash_bytes, MODE_SHADOW, MODE_ON, METRIC_LEAST_REQUESTS,
)
cimport fastroute.core._index as ix
cimport fastroute.core._coindex as cx
from fastroute.core._random cimport mix64
import mmap
import os

import numpy as np

from fastroute.names import LOAD_METRIC_CODE, MODE_CODE

cdef enum:
    KIND_ROUND_ROBIN = 0
    KIND_RANDOM = 1
    KIND_P2C = 2
    KIND_RING = 3

# Most synced replicas a coordinated pick plans for (more share the last slots).
cdef enum:
    MAX_SLOTS = 64
    # A replica whose recent picks were at least this share (/1024, ~30%) a view's later
    # ones treats every pick as part of a burst (see Picker._coordinated).
    BURSTY_SHARE = 307

# Policy name -> compiled picker kind (cache_aware is not here: its tree picks, Picker books).
KINDS = {"round_robin": KIND_ROUND_ROBIN, "random": KIND_RANDOM, "power_of_two": KIND_P2C,
         "consistent_hashing": KIND_RING}


cdef inline void _book(int64_t *row, int64_t tokens) noexcept nogil:
    fr_add_i64(&row[COL_IN_FLIGHT], 1)
    fr_add_i64(&row[COL_IN_FLIGHT_TOKENS], tokens)
    fr_add_i64(&row[COL_PICKS], 1)


cdef inline bint _dec_floor(int64_t *cell, int64_t v) noexcept nogil:
    # Subtract v unless that would take the cell below zero; CAS loop so concurrent releases
    # from other processes are never lost.  Returns False (nothing applied) on underflow.
    cdef int64_t cur = fr_load_i64(cell)
    while True:
        if cur < v:
            return False
        if fr_cas_i64(cell, &cur, cur - v):
            return True


cdef inline int64_t _swap(int64_t *cell, int64_t v) noexcept nogil:
    # A store as a read-modify-write (a full barrier): a write published to the feed must not
    # let the feed switch's load pass it (see _layout.feed_publish).  Returns the value before.
    cdef int64_t cur = fr_load_i64(cell)
    while not fr_cas_i64(cell, &cur, v):
        pass
    return cur


cdef inline void _release_tokens(int64_t *row, int64_t tokens, int64_t *header) noexcept nogil:
    if not _dec_floor(&row[COL_IN_FLIGHT_TOKENS], tokens):
        fr_add_i64(&header[HDR_UNDERFLOWS], 1)


cdef inline void _release(int64_t *row, int64_t tokens, int64_t *header) noexcept nogil:
    if not _dec_floor(&row[COL_IN_FLIGHT], 1):
        fr_add_i64(&header[HDR_UNDERFLOWS], 1)
        return
    _release_tokens(row, tokens, header)


@cython.freelist(256)
cdef class Lease:
    """One booking of one target; ``release()`` undoes it exactly once."""
    cdef int64_t *_row
    cdef int64_t *_own         # this process's ledger row (multi-process), or NULL
    cdef int64_t *_header
    cdef readonly int64_t target
    cdef readonly int64_t tokens
    cdef bint _released
    cdef bint _until_answer    # the input tokens end with the leg's answer (answered())
    cdef object _keep          # the buffer owner, so the row pointer stays valid

    def answered(self):
        """The target has answered (a PD prefill leg's response ended): when the lease's
        group counts input tokens only until then, give them back now and keep the request
        booked until release().  True when tokens were given back."""
        if self._released or not self._until_answer or self.tokens == 0:
            return False
        if self._own != NULL:
            _release_tokens(self._own, self.tokens, self._header)
        _release_tokens(self._row, self.tokens, self._header)
        feed_publish(self._header, self.target)
        self.tokens = 0
        return True

    def release(self):
        if self._released:
            return False
        self._released = True
        # Own ledger first: a process killed between the two leaks one table booking rather
        # than letting the supervisor subtract it a second time from a shared counter.
        if self._own != NULL:
            _release(self._own, self.tokens, self._header)
        _release(self._row, self.tokens, self._header)
        feed_publish(self._header, self.target)
        return True

    @property
    def released(self):
        return self._released

    def __repr__(self):
        return f"<Lease target={self.target} tokens={self.tokens} released={self._released}>"


cdef Lease _new_lease(int64_t[:, ::1] tab, int64_t *header, int64_t t, int64_t tokens, object keep,
                      int64_t *own_base=NULL):
    cdef Lease lease = Lease.__new__(Lease)
    lease._row = &tab[t, 0]
    lease._header = header
    lease.target = t
    lease.tokens = tokens
    lease._released = False
    lease._until_answer = False
    lease._keep = keep
    _book(lease._row, tokens)
    feed_publish(header, t)
    # Table first, then the own ledger (see release for the reverse order).
    if own_base != NULL:
        lease._own = own_base + t * NCOLS
        _book(lease._own, tokens)
    else:
        lease._own = NULL
    return lease


cdef int _check_arrays(int64_t[:, ::1] tab, int64_t[::1] header) except -1:
    # The shapes every compiled entry point relies on: full rows, and a header that holds
    # HDR_UNDERFLOWS (releases write it without bounds checks).
    if tab.shape[1] != NCOLS:
        raise ValueError(f"not a target table: {tab.shape[1]} columns, expected {NCOLS}")
    if header.shape[0] < NHDR:
        raise ValueError(f"table header has {header.shape[0]} cells, expected {NHDR}")
    return 0


def book(int64_t[:, ::1] tab, int64_t[::1] header, int64_t t, int64_t tokens, keep=None):
    """Book target ``t`` directly (tests, and the multi-process ledger checks); returns its Lease."""
    _check_arrays(tab, header)
    if t < 0 or t >= tab.shape[0]:
        raise IndexError(f"target {t} out of range")
    return _new_lease(tab, &header[0], t, tokens, keep)


def stress_book_release(int64_t[:, ::1] tab, int64_t[::1] header, const int64_t[::1] targets,
                        int64_t rounds, int64_t tokens):
    """Book every target then release it, ``rounds`` times, without the GIL: the multi-process
    test runs this in several processes at once and checks that the totals come back exact."""
    cdef int64_t r
    cdef Py_ssize_t k
    _check_arrays(tab, header)
    for k in range(targets.shape[0]):
        if targets[k] < 0 or targets[k] >= tab.shape[0]:
            raise IndexError(f"target {targets[k]} out of range")
    with nogil:
        for r in range(rounds):
            for k in range(targets.shape[0]):
                _book(&tab[targets[k], 0], tokens)
                feed_publish(&header[0], targets[k])
            for k in range(targets.shape[0]):
                _release(&tab[targets[k], 0], tokens, &header[0])
                feed_publish(&header[0], targets[k])


# ---- atomic access for the Python side of the table (monitor, metrics, tests) --------------------
# Single cells go through ``Cells`` (below), which holds the array's buffer once.  Every entry
# point checks the row and column it is given (the module is built without bounds checks, so an
# unchecked index would read or write outside the table); the checks are two unsigned compares.

cdef class Cells:
    """Atomic access to one table array (the circuit breaker on the data path, the table's
    Python readers and writers).

    The object holds the array's buffer once, so a call costs a method dispatch, the index
    check and the atomic itself.
    """
    cdef int64_t[:, ::1] tab
    cdef readonly int64_t rows
    cdef readonly int cols
    cdef int64_t[::1] header       # the table's header: writes are published to its feed
    cdef int64_t *feed             # &header[0], or NULL (a header's own Cells, a plain array)

    def __init__(self, table_array, header_array=None):
        self.tab = table_array
        self.rows = self.tab.shape[0]
        self.cols = <int>self.tab.shape[1]
        self.feed = NULL
        if header_array is not None:
            self.header = header_array
            if self.header.shape[0] < NHDR or self.cols != NCOLS:
                raise ValueError(f"a table's Cells need its {NCOLS} columns and {NHDR} header cells")
            self.feed = &self.header[0]

    cdef inline int _cell(self, int64_t t, int col) except -1:
        # One unsigned compare per index also rejects negatives (they wrap to huge values).
        if <uint64_t>t >= <uint64_t>self.rows:
            raise IndexError(f"row {t} out of range 0..{self.rows - 1}")
        if <unsigned int>col >= <unsigned int>self.cols:
            raise IndexError(f"column {col} out of range 0..{self.cols - 1}")
        return 0

    cpdef int64_t load(self, int64_t t, int col) except? -1:
        self._cell(t, col)
        return fr_load_i64(&self.tab[t, col])

    cpdef void store(self, int64_t t, int col, int64_t v) except *:
        self._cell(t, col)
        if self.feed == NULL:
            fr_store_i64(&self.tab[t, col], v)
            return
        if _swap(&self.tab[t, col], v) != v:  # a rewrite of the same value (a health round) changes no key
            feed_publish(self.feed, t)

    cpdef int64_t add(self, int64_t t, int col, int64_t v) except? -1:
        """Adds ``v``; returns the value after the addition (this caller's own result)."""
        self._cell(t, col)
        cdef int64_t was = fr_add_i64(&self.tab[t, col], v)
        if self.feed != NULL:
            feed_publish(self.feed, t)
        return was + v

    cpdef bint cas(self, int64_t t, int col, int64_t expected, int64_t desired) except -1:
        self._cell(t, col)
        cdef bint done = fr_cas_i64(&self.tab[t, col], &expected, desired) != 0
        if done and self.feed != NULL:
            feed_publish(self.feed, t)
        return done

    cpdef int64_t ok_closed(self, int64_t t) except? -1:
        """A success on target ``t``: returns its circuit state; when closed, also ends a
        failure streak.  Two loads and no write in the common case (closed, no streak)."""
        if <uint64_t>t >= <uint64_t>self.rows or self.cols != NCOLS:
            raise IndexError(f"row {t} out of range 0..{self.rows - 1} of a {NCOLS}-column table")
        cdef int64_t *row = &self.tab[t, 0]
        cdef int64_t c = fr_load_i64(&row[COL_CIRCUIT])
        if c == CIRCUIT_CLOSED and fr_load_i64(&row[COL_CB_FAILS]) != 0:
            fr_store_i64(&row[COL_CB_FAILS], 0)
        return c

    def first_where(self, int col, int64_t value, int64_t start=0):
        """The first row at or after ``start`` whose cell ``col`` holds ``value``, or -1
        (one atomic load per row scanned, in compiled code: the table's free-row search)."""
        cdef int64_t t
        if <unsigned int>col >= <unsigned int>self.cols:
            raise IndexError(f"column {col} out of range 0..{self.cols - 1}")
        if start < 0:
            start = 0
        for t in range(start, self.rows):
            if fr_load_i64(&self.tab[t, col]) == value:
                return t
        return -1

    def rows_where(self, int col, int64_t value):
        """Rows whose cell ``col`` holds ``value`` (one atomic load per row, no GIL release)."""
        cdef list out = []
        cdef int64_t t
        if <unsigned int>col >= <unsigned int>self.cols:
            raise IndexError(f"column {col} out of range 0..{self.cols - 1}")
        for t in range(self.rows):
            if fr_load_i64(&self.tab[t, col]) == value:
                out.append(t)
        return out


def store_polled(int64_t[:, ::1] tab, int64_t t, int64_t running, int64_t waiting,
                 int64_t tokens, int64_t max_tokens, int64_t at_ms, int64_t uncached=-1,
                 int64_t kv_queue=0, int64_t[::1] header=None):
    """Store one poll of target ``t`` (the monitor's write); with the table's ``header``, the
    row is published to the pickers' load indexes."""
    if tab.shape[1] != NCOLS:
        raise ValueError(f"not a target table: {tab.shape[1]} columns, expected {NCOLS}")
    if header is not None and header.shape[0] < NHDR:
        raise ValueError(f"table header has {header.shape[0]} cells, expected {NHDR}")
    if t < 0 or t >= tab.shape[0]:
        raise IndexError(f"target {t} out of range")
    # POLLED_AT goes last: a reader that sees the new timestamp sees the new values too.
    fr_store_i64(&tab[t, COL_POLLED_RUNNING], running)
    fr_store_i64(&tab[t, COL_POLLED_WAITING], waiting)
    fr_store_i64(&tab[t, COL_POLLED_TOKENS], tokens)
    fr_store_i64(&tab[t, COL_POLLED_MAX_TOKENS], max_tokens)
    fr_store_i64(&tab[t, COL_POLLED_UNCACHED], uncached)
    fr_store_i64(&tab[t, COL_POLLED_KV_QUEUE], kv_queue)
    # The in-flight tokens of every replica at this poll: kv_free counts bookings since then.
    fr_store_i64(&tab[t, COL_TOKENS_AT_POLL], row_tokens(&tab[t, 0]))
    if header is None:
        fr_store_i64(&tab[t, COL_POLLED_AT], at_ms)
    else:
        _swap(&tab[t, COL_POLLED_AT], at_ms)
        feed_publish(&header[0], t)


def snapshot(int64_t[:, ::1] tab, int64_t n):
    """Atomic-load copy of the first n rows (a consistent value per cell, not across cells)."""
    if tab.shape[1] != NCOLS:
        raise ValueError(f"not a target table: {tab.shape[1]} columns, expected {NCOLS}")
    if n < 0 or n > tab.shape[0]:
        raise ValueError(f"snapshot of {n} rows from a table of {tab.shape[0]}")
    out = np.empty((n, NCOLS), dtype=np.int64)
    cdef int64_t[:, ::1] o = out
    cdef int64_t t
    cdef int c
    for t in range(n):
        for c in range(NCOLS):
            o[t, c] = fr_load_i64(&tab[t, c])
    return out




def snapshot_cols(int64_t[:, ::1] tab, int64_t n, const int64_t[::1] cols):
    """Atomic-load copy of the columns ``cols`` of the first n rows, (n, len(cols))."""
    cdef Py_ssize_t j
    cdef int64_t t
    if tab.shape[1] != NCOLS:
        raise ValueError(f"not a target table: {tab.shape[1]} columns, expected {NCOLS}")
    if n < 0 or n > tab.shape[0]:
        raise ValueError(f"snapshot of {n} rows from a table of {tab.shape[0]}")
    for j in range(cols.shape[0]):
        if cols[j] < 0 or cols[j] >= NCOLS:
            raise IndexError(f"column {cols[j]} out of range 0..{NCOLS - 1}")
    out = np.empty((n, cols.shape[0]), dtype=np.int64)
    cdef int64_t[:, ::1] o = out
    for t in range(n):
        for j in range(cols.shape[0]):
            o[t, j] = fr_load_i64(&tab[t, cols[j]])
    return out

# ---- replica sync (fastroute/control/syncdelta.py): a peer's lines in, the others' sums out ----

cdef extern from *:
    void _prefetch "__builtin_prefetch"(const void *addr) noexcept nogil

cdef enum:
    # Lines sync_decode parses before it looks their names up: the lookups' cache misses
    # (a slot, the name's bytes, the peer's cells) are then in flight together.
    DECODE_BATCH = 16
    # a NameIndex slot: the name's hash (0: empty), position, offset in utf8, length
    SLOT_HASH = 0
    SLOT_POS = 1
    SLOT_AT = 2
    SLOT_LEN = 3


cdef class NameIndex:
    """This host's target names (UTF-8, position i the i-th given) and the position of each, for
    the sync's compiled code: the names in one buffer (``utf8``, name i at
    ``utf8[at[i]:at[i + 1]]``) and an open-addressing table of their hashes checked against
    those bytes, so a lookup makes no Python object (a dict needs a bytes key per line)."""

    cdef readonly bytes utf8
    cdef readonly object at
    cdef const unsigned char[::1] _utf8
    cdef int64_t[:, ::1] _slots  # SLOT_* per slot, a cache line holds two
    cdef uint64_t _mask

    def __init__(self, names):
        names = list(names)
        cdef Py_ssize_t n = len(names), i, cap = 16
        cdef uint64_t h, j
        self.utf8 = b"".join(names)
        at = np.zeros(n + 1, np.int64)
        at[1:] = np.cumsum([len(b) for b in names])
        self.at = at
        self._utf8 = self.utf8
        cdef const int64_t[::1] offs = at
        while cap < 2 * n:
            cap *= 2
        self._slots = np.zeros((cap, 4), np.int64)
        self._mask = cap - 1
        for i in range(n):
            if self.find(names[i]) is not None:
                raise ValueError(f"NameIndex: {names[i]!r} given twice")
            h = self._hashed(self._name(offs[i]), offs[i + 1] - offs[i])
            j = h & self._mask
            while self._slots[j, SLOT_HASH] != 0:
                j = (j + 1) & self._mask
            self._slots[j, SLOT_HASH] = <int64_t>h
            self._slots[j, SLOT_POS] = i
            self._slots[j, SLOT_AT] = offs[i]
            self._slots[j, SLOT_LEN] = offs[i + 1] - offs[i]

    cdef inline const unsigned char *_name(self, int64_t at) noexcept nogil:
        return &self._utf8[at] if at < self._utf8.shape[0] else NULL

    cdef inline uint64_t _hashed(self, const unsigned char *p, Py_ssize_t n) noexcept nogil:
        # eight bytes a step (a name is ~30 bytes: a byte-wise hash was most of a lookup)
        cdef uint64_t h = <uint64_t>n * <uint64_t>0x9E3779B97F4A7C15, w = 0
        cdef Py_ssize_t i = 0
        while i + 8 <= n:
            memcpy(&w, p + i, 8)
            h = (h ^ w) * <uint64_t>0xFF51AFD7ED558CCD
            h ^= h >> 32
            i += 8
        if i < n:
            w = 0
            memcpy(&w, p + i, n - i)
            h = (h ^ w) * <uint64_t>0xFF51AFD7ED558CCD
        h = mix64(h)
        return h if h != 0 else 1

    cdef inline const int64_t *_first(self, uint64_t h) noexcept nogil:
        return &self._slots[h & self._mask, 0]

    cdef Py_ssize_t _lookup(self, const unsigned char *p, Py_ssize_t n, uint64_t h) noexcept nogil:
        """The position of the name ``p[:n]`` of hash ``h``, or -1."""
        cdef uint64_t j = h & self._mask
        cdef const int64_t *e
        while True:
            e = &self._slots[j, 0]
            if e[SLOT_HASH] == 0:
                return -1
            if <uint64_t>e[SLOT_HASH] == h and e[SLOT_LEN] == n and (
                n == 0 or memcmp(&self._utf8[e[SLOT_AT]], p, n) == 0
            ):
                return e[SLOT_POS]
            j = (j + 1) & self._mask

    def find(self, const unsigned char[::1] name):
        """The position of ``name``, or None."""
        cdef const unsigned char *p = &name[0] if name.shape[0] else NULL
        cdef Py_ssize_t i = self._lookup(p, name.shape[0], self._hashed(p, name.shape[0]))
        return None if i < 0 else i

    def __len__(self):
        return len(self.at) - 1


cdef inline int _sync_number(const unsigned char *d, Py_ssize_t a, Py_ssize_t b,
                             uint64_t *out, bint *neg) noexcept:
    """One count field: an optional sign and ASCII digits, 1..19 characters in all; 0 when it is
    not one (stricter than Python's int(): no spaces, no underscores)."""
    cdef uint64_t v = 0
    cdef Py_ssize_t i = a
    neg[0] = False
    if b - a < 1 or b - a > 19:
        return 0
    if d[i] == 45 or d[i] == 43:  # '-' / '+'
        neg[0] = d[i] == 45
        i += 1
        if i == b:
            return 0
    while i < b:
        if d[i] < 48 or d[i] > 57:
            return 0
        v = v * 10 + (d[i] - 48)
        i += 1
    out[0] = v
    return 1


def sync_decode(const unsigned char[::1] data, NameIndex index not None, int64_t[:, :, ::1] vals, Py_ssize_t slot,
                unsigned char[::1] mark, list touched, bint add, int64_t limit):
    """Read ``name\\trequests\\ttokens\\topen`` lines into ``vals[index[name], slot]`` (names this host
    does not know are read and dropped); a name seen the first time since ``mark`` was cleared
    is appended to ``touched``. ``add``: sum repeated names (a whole payload), else the last
    line of a name wins (a delta of absolute values). A line that is not four tab-separated
    fields, or a count past ``limit``, is skipped; a negative count is 0, sums stay below
    ``limit``. Returns (good lines, skipped lines)."""
    if vals.shape[2] != 3 or mark.shape[0] < vals.shape[0] or limit <= 0:
        raise ValueError("sync_decode: vals must be (names, slots, 3) and mark cover every name")
    if slot < 0 or slot >= vals.shape[1]:
        raise IndexError(f"sync_decode: slot {slot} outside 0..{vals.shape[1] - 1}")
    if len(index) > vals.shape[0]:
        raise IndexError(f"sync_decode: {len(index)} names, vals holds {vals.shape[0]}")
    if data.shape[0] == 0:
        return 0, 0
    return _decode(&data[0], data.shape[0], index, vals, slot, mark, touched, add, limit)


def sync_entries(list reply, Py_ssize_t start, dict seq, dict slots, set whole, NameIndex index not None,
                 int64_t[:, :, ::1] vals, unsigned char[::1] mark, list touched, int64_t limit):
    """The new entries of the peers a view follows, from a tick's reply (``reply[start:]``, an
    (id, number, kind, value) each), applied in one call as ``control/replica.py`` reads them: an
    entry of a peer not in ``seq`` or read whole this tick (``whole``), or numbered at most the
    last applied, is passed over; the next entry of a peer that has a slot (``slots``) is
    decoded into it (``sync_decode``, the last line of a name winning) and its number stored.
    Any other entry (oversize, a number missing, a peer without a slot) and every later entry
    of that peer are left to the caller: returns (their positions in order, skipped lines, a
    peer that sent some)."""
    cdef Py_ssize_t i, n = len(reply), slot
    cdef int64_t good, bad, bad_total = 0
    cdef object pid, last, kind, value, num, bad_peer = None
    cdef list later = []
    cdef set held = set()
    if (n - start) % 4 or start < 0:
        raise ValueError(f"sync_entries: {n - start} fields from {start} are not whole entries")
    if vals.shape[2] != 3 or mark.shape[0] < vals.shape[0] or limit <= 0 or len(index) > vals.shape[0]:
        raise ValueError("sync_entries: vals must be (names, slots, 3) and mark cover every name")
    for i in range(start, n, 4):
        pid = reply[i]
        if pid in held:
            later.append(i)
            continue
        last = seq.get(pid)
        if last is None or pid in whole:
            continue
        num = int(reply[i + 1])
        if num <= last:
            continue
        kind = reply[i + 2]
        value = reply[i + 3]
        got = slots.get(pid)
        if kind == 2 or num != last + 1 or got is None or type(value) is not bytes:
            later.append(i)
            held.add(pid)
            continue
        slot = got
        if slot < 0 or slot >= vals.shape[1]:
            raise IndexError(f"sync_entries: slot {slot} outside 0..{vals.shape[1] - 1}")
        if PyBytes_GET_SIZE(value):
            good, bad = _decode(<const unsigned char *>PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value),
                                index, vals, slot, mark, touched, False, limit)
            if bad:
                bad_total += bad
                bad_peer = pid
        seq[pid] = num
    return later, bad_total, bad_peer


cdef (int64_t, int64_t) _decode(const unsigned char *data, Py_ssize_t n, NameIndex index,
                                int64_t[:, :, ::1] vals, Py_ssize_t slot, unsigned char[::1] mark,
                                list touched, bint add, int64_t limit) except *:
    # sync_decode's work, its arguments checked by the caller
    cdef Py_ssize_t start = 0, end
    cdef Py_ssize_t tabs[3]
    cdef int ntab, nb, b
    cdef uint64_t r, k, o
    cdef bint nr, nk, no
    cdef int64_t good = 0, bad = 0, idx, cap = limit - 1
    cdef int64_t *into
    cdef const int64_t *e
    cdef const unsigned char *hit
    # a batch of parsed lines: name start and length, its hash, the counts, then its position
    cdef Py_ssize_t b_at[DECODE_BATCH]
    cdef Py_ssize_t b_len[DECODE_BATCH]
    cdef uint64_t b_hash[DECODE_BATCH]
    cdef int64_t b_val[DECODE_BATCH][3]
    cdef int64_t b_pos[DECODE_BATCH]
    while start < n:
        nb = 0
        while start < n and nb < DECODE_BATCH:
            # the line's end and its tabs, found by memchr (a line is ~45 bytes: byte by byte
            # was most of a decode's instructions)
            hit = <const unsigned char *>memchr(data + start, 10, n - start)
            end = hit - data if hit != NULL else n
            ntab = 0
            hit = data + start
            while ntab < 4:
                hit = <const unsigned char *>memchr(hit, 9, end - (hit - data))
                if hit == NULL:
                    break
                if ntab < 3:
                    tabs[ntab] = hit - data
                ntab += 1
                hit += 1
            if ntab != 3 or not (
                _sync_number(data, tabs[0] + 1, tabs[1], &r, &nr)
                and _sync_number(data, tabs[1] + 1, tabs[2], &k, &nk)
                and _sync_number(data, tabs[2] + 1, end, &o, &no)
            ) or (not nr and r >= <uint64_t>limit) or (not nk and k >= <uint64_t>limit):
                if end > start:
                    bad += 1
                elif end < n:
                    bad += 1  # an empty line
                start = end + 1
                continue
            good += 1
            b_at[nb] = start
            b_len[nb] = tabs[0] - start
            b_hash[nb] = index._hashed(&data[start], b_len[nb])
            _prefetch(index._first(b_hash[nb]))
            b_val[nb][0] = 0 if nr else <int64_t>r
            b_val[nb][1] = 0 if nk else <int64_t>k
            b_val[nb][2] = 1 if o else 0  # any nonzero count, either sign
            nb += 1
            start = end + 1
        for b in range(nb):  # the first slots are in cache: fetch the names and cells they hold
            e = index._first(b_hash[b])
            if e[SLOT_HASH] != 0:
                _prefetch(&index._utf8[e[SLOT_AT]] if e[SLOT_LEN] else NULL)
                _prefetch(&vals[e[SLOT_POS], slot, 0])
        for b in range(nb):
            b_pos[b] = index._lookup(&data[b_at[b]], b_len[b], b_hash[b])
        for b in range(nb):
            idx = b_pos[b]
            if idx < 0:
                continue
            into = &vals[idx, slot, 0]
            if mark[idx] == 0:
                mark[idx] = 1
                touched.append(idx)
            if add:
                into[0] = min(into[0] + b_val[b][0], cap)
                into[1] = min(into[1] + b_val[b][1], cap)
                into[2] = into[2] | b_val[b][2]
            else:
                into[0] = b_val[b][0]
                into[1] = b_val[b][1]
                into[2] = b_val[b][2]
    return good, bad


cdef inline Py_ssize_t _put_count(unsigned char *p, int64_t v) noexcept nogil:
    """The decimal digits of ``v`` (a '-' first when negative) at ``p``; returns their number
    (at most 20)."""
    cdef unsigned char rev[20]
    cdef uint64_t u = <uint64_t>v
    cdef Py_ssize_t n = 0, i = 0
    if v < 0:
        p[0] = 45
        i = 1
        u = <uint64_t>0 - u  # INT64_MIN's magnitude fits in uint64
    while True:
        rev[n] = 48 + <unsigned char>(u % 10)
        n += 1
        u //= 10
        if u == 0:
            break
    while n:
        n -= 1
        p[i] = rev[n]
        i += 1
    return i


def sync_encode(int64_t[:, ::1] tab, const int64_t[::1] rows, int64_t[:, ::1] seen, list held,
                const unsigned char[::1] names, const int64_t[::1] offsets, unsigned char[::1] out,
                bint every):
    """This replica's side of a tick when every name has one row (``rows[i]`` the row of name
    i), in one pass: each name whose requests, tokens or open circuit differ from ``seen[i]``
    (updated in place) is written to ``out`` as a ``name\\trequests\\ttokens\\topen\\n`` line
    (``every``: each name with anything nonzero, changed or not); name i is
    ``names[offsets[i]:offsets[i + 1]]`` (UTF-8). Rows holding an estimate of the others'
    placements are appended to ``held``. Returns the payload, or None when ``out`` is shorter
    than the payload could be (``seen`` and ``held`` untouched: call again with
    ``len(names) + 64 * len(rows)`` bytes)."""
    cdef Py_ssize_t i, n = rows.shape[0], w = 0, a, b
    cdef int64_t t, r, k, o
    cdef bint changed
    if tab.shape[1] != NCOLS:
        raise ValueError(f"not a target table: {tab.shape[1]} columns, expected {NCOLS}")
    if seen.shape[0] != n or seen.shape[1] != 3 or offsets.shape[0] != n + 1:
        raise ValueError("sync_encode: seen must be (len(rows), 3) and offsets hold len(rows) + 1 bounds")
    if offsets[0] < 0 or offsets[n] > names.shape[0]:
        raise IndexError("sync_encode: offsets outside the names")
    for i in range(n):
        if rows[i] < 0 or rows[i] >= tab.shape[0]:
            raise IndexError(f"sync_encode: row {rows[i]} outside the table")
        if offsets[i] > offsets[i + 1]:
            raise IndexError(f"sync_encode: name {i} ends before it starts")
    # a line is its name, three counts of at most 20 characters and four separators
    if out.shape[0] < offsets[n] - offsets[0] + 64 * n:
        return None
    for i in range(n):
        if i + 8 < n:  # a row's cells span three cache lines: ask for those of rows ahead
            t = rows[i + 8]
            _prefetch(&tab[t, COL_IN_FLIGHT])
            _prefetch(&tab[t, COL_CIRCUIT])
            _prefetch(&tab[t, COL_OTHERS_EST])
        t = rows[i]
        r = fr_load_i64(&tab[t, COL_IN_FLIGHT])
        k = fr_load_i64(&tab[t, COL_IN_FLIGHT_TOKENS])
        o = 1 if fr_load_i64(&tab[t, COL_CIRCUIT]) == CIRCUIT_OPEN else 0
        if fr_load_i64(&tab[t, COL_OTHERS_EST]) != 0:
            held.append(t)
        changed = r != seen[i, 0] or k != seen[i, 1] or o != seen[i, 2]
        if changed:
            seen[i, 0] = r
            seen[i, 1] = k
            seen[i, 2] = o
        if not ((r or k or o) if every else changed):
            continue
        a = offsets[i]
        b = offsets[i + 1]
        if b > a:
            memcpy(&out[w], &names[a], b - a)
        w += b - a
        out[w] = 9
        w += 1 + _put_count(&out[w + 1], r)
        out[w] = 9
        w += 1 + _put_count(&out[w + 1], k)
        out[w] = 9
        out[w + 1] = 48 + <unsigned char>o
        out[w + 2] = 10
        w += 3
    return PyBytes_FromStringAndSize(<const char *>&out[0], w) if w else b""

cdef inline bint _store_changed(int64_t *cell, int64_t v) noexcept nogil:
    if fr_load_i64(cell) != v:  # an unchanged cell is not written (the pickers' cache lines)
        _swap(cell, v)  # a barrier before the feed notice (see _layout.feed_publish)
        return True
    return False


def sync_store(int64_t[:, ::1] tab, int64_t[::1] header, const int64_t[:, :, ::1] vals, const int64_t[::1] slots,
               const int64_t[::1] names, const int64_t[::1] starts, const int64_t[::1] rows,
               int64_t limit):
    """Store the others' sums of each name in ``names`` (over the peers' ``slots`` of
    ``vals`` (names, slots, 3): a name's peers side by side; requests and tokens capped below ``limit``, open if any) into the others columns
    of the allocated rows ``rows[starts[name]:starts[name + 1]]`` of the table; a row whose
    cells changed is published to the pickers' load indexes (the table's ``header``)."""
    cdef Py_ssize_t i, j, s
    cdef int64_t name, t, r, k, o, v, w, cap = limit - 1
    cdef bint moved
    _check_arrays(tab, header)
    if vals.shape[2] != 3 or starts.shape[0] != vals.shape[0] + 1 or limit <= 0:
        raise ValueError("sync_store: vals must be (names, slots, 3) and starts hold names + 1 bounds")
    for j in range(slots.shape[0]):
        if slots[j] < 0 or slots[j] >= vals.shape[1]:
            raise IndexError(f"sync_store: slot {slots[j]} outside 0..{vals.shape[1] - 1}")
    for i in range(names.shape[0]):
        name = names[i]
        if name < 0 or name >= vals.shape[0]:
            raise IndexError(f"sync_store: name {name} outside 0..{vals.shape[0] - 1}")
        if starts[name] < 0 or starts[name] > starts[name + 1] or starts[name + 1] > rows.shape[0]:
            raise IndexError(f"sync_store: rows of name {name} outside the rows given")
        for s in range(starts[name], starts[name + 1]):
            if rows[s] < 0 or rows[s] >= tab.shape[0]:
                raise IndexError(f"sync_store: row {rows[s]} outside the table")
    for i in range(names.shape[0]):
        # names ahead: their peers' cells and bounds now, their rows' cells a little later
        if i + 8 < names.shape[0]:
            _prefetch(&vals[names[i + 8], 0, 0])
            _prefetch(&vals[names[i + 8], vals.shape[1] - 1, 2])
            _prefetch(&starts[names[i + 8]])
        if i + 4 < names.shape[0] and starts[names[i + 4]] < starts[names[i + 4] + 1]:
            t = rows[starts[names[i + 4]]]
            _prefetch(&tab[t, COL_ALLOCATED])
            _prefetch(&tab[t, COL_OTHERS_TOKENS])
        name = names[i]
        r = k = o = 0
        for j in range(slots.shape[0]):
            # each term is clamped to 0..cap (cap < 2^62): a sum of two never overflows
            v = min(max(vals[name, slots[j], 0], 0), cap)
            w = min(max(vals[name, slots[j], 1], 0), cap)
            r = min(r + v, cap)
            k = min(k + w, cap)
            o |= vals[name, slots[j], 2]
        o = 1 if o else 0
        for s in range(starts[name], starts[name + 1]):
            t = rows[s]
            if fr_load_i64(&tab[t, COL_ALLOCATED]) == 0:
                continue
            moved = _store_changed(&tab[t, COL_OTHERS_IN_FLIGHT], r)
            moved = _store_changed(&tab[t, COL_OTHERS_TOKENS], k) or moved
            moved = _store_changed(&tab[t, COL_OTHERS_OPEN], o) or moved
            if moved:
                feed_publish(&header[0], t)


cpdef bint mapped(obj):
    """Whether an array's memory is still there: False once the mmap it views was closed
    (TargetTable.close() unmaps its segment whoever still holds its arrays)."""
    while obj is not None:
        if isinstance(obj, mmap.mmap):
            return not obj.closed
        obj = obj.obj if isinstance(obj, memoryview) else getattr(obj, "base", None)
    return True


@cython.no_gc_clear  # __dealloc__ gives back the picker's feed uses through its header
cdef class Picker:
    """A candidate set with its policy, compiled: ``acquire(tokens, key)`` picks and books.

    policy: round_robin | random | power_of_two | consistent_hashing; metric for power_of_two;
    demand: 0 off, 1 shadow (pick by policy, also compute the demand pick and count agreement),
    2 on (pick by demand cost).  Candidates and ring are replaced wholesale when workers change.
    """
    cdef int64_t[:, ::1] tab
    cdef int64_t[::1] header
    cdef int64_t[::1] cands
    cdef uint64_t[::1] ring_hash
    cdef int64_t[::1] ring_target
    cdef int kind
    cdef int metric
    cdef readonly int demand
    cdef readonly int64_t weight
    cdef uint64_t rng
    cdef int64_t cursor
    cdef object keep
    cdef int64_t[:, ::1] own
    cdef int64_t *own_base
    cdef readonly int64_t shadow_agree
    cdef readonly int64_t shadow_disagree
    cdef readonly int64_t last_legacy
    cdef readonly int64_t last_demand
    cdef readonly int kv_fit
    cdef readonly int64_t kv_reserve
    cdef readonly int64_t kv_agree
    cdef readonly int64_t kv_disagree
    cdef readonly int64_t kv_fallback
    cdef int64_t[::1] scratch        # pick_coordinated: 2 x candidates, then 2 x MAX_SLOTS + 1
    cdef int64_t coord_n             # placements of the last coordinated pick (0: none)
    cdef bint coord_tokens           # whether that pick books the others' input tokens too
    cdef int64_t coord_slot
    cdef int64_t coord_tick          # sync tick of the last coordinated pick (-1: none yet)
    cdef int64_t coord_burst         # share of recent picks that were not a view's first, /1024
    cdef readonly int64_t coordinated_picks
    cdef public bint tokens_until_answer   # leases count input tokens until answered()
    cdef ix.Index idx                # the load index (_index.pxd); kind INDEX_NONE: none
    cdef object idx_keep             # the arrays its pointers are into
    cdef cx.Coord cidx               # the coordinated index (_coindex.pxd), built at first use
    cdef object cidx_keep            # the arrays its pointers are into
    cdef bint cidx_ok                # the candidates and policy call for it (synced replicas)
    cdef readonly int64_t feed_uses  # indexes held: each keeps the header's feed on
    cdef int64_t[::1] own_hdr        # the own ledger's header: its feed uses, for a reclaim
    cdef int64_t *own_hdr_base

    def __init__(self, table_array, header_array, str policy, str metric="tokens", int demand=0,
                 int64_t weight=0, seed=None, int kv_fit=0, int64_t kv_reserve=0):
        if policy not in KINDS:
            raise ValueError(f"policy {policy!r} has no compiled picker")
        if metric not in LOAD_METRIC_CODE:
            raise ValueError(f"unknown load metric {metric!r}")
        if demand not in MODE_CODE.values():
            raise ValueError("demand must be 0 (off), 1 (shadow) or 2 (on)")
        if weight < 0:
            raise ValueError("request weight must be >= 0")
        if kv_fit not in MODE_CODE.values():
            raise ValueError("kv_fit must be 0 (off), 1 (shadow) or 2 (on)")
        if kv_reserve < 0:
            raise ValueError("kv reserve must be >= 0")
        self.kv_fit = kv_fit
        self.kv_reserve = kv_reserve
        self.tab = table_array
        self.header = header_array
        _check_arrays(self.tab, self.header)
        self.keep = (table_array, header_array)
        self.kind = KINDS[policy]
        self.metric = LOAD_METRIC_CODE[metric]
        self.demand = demand
        self.weight = weight
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self.rng = <uint64_t>(int(seed) & 0xFFFFFFFFFFFFFFFF)
        self.cursor = 0
        self.cands = np.zeros(0, dtype=np.int64)
        self.scratch = np.zeros(2 * MAX_SLOTS + 1, dtype=np.int64)
        self.ring_hash = np.zeros(0, dtype=np.uint64)
        self.ring_target = np.zeros(0, dtype=np.int64)
        self.last_legacy = -1
        self.last_demand = -1
        self.coord_tick = -1
        self.coord_burst = 0
        self.tokens_until_answer = False
        self.own_base = NULL
        self.own_hdr_base = NULL

    def __dealloc__(self):
        # A table or own ledger closed under the picker (its mapping gone) is not written: the
        # uses stay counted (the safe side), in the table for whoever still maps it and in the
        # own ledger, from which the supervisor gives them back when this process exits.
        if self.feed_uses == 0 or not mapped(self.keep[1]):
            return
        if self.own_hdr_base != NULL and not mapped(self.own_hdr):
            return
        self._feed_use(-self.feed_uses)

    cdef void _feed_use(self, int64_t d) noexcept:
        # Take (d > 0) or give back (d < 0) uses of the header's feed: writers publish while
        # any index holds one (_layout.feed_publish).  Taken in the table before the own
        # ledger's header and given back in the reverse order: a process killed between the
        # two leaves the table a use too many (the feed stays on: work, never a stale index),
        # never one too few; its supervisor gives back what the own ledger holds.
        if d > 0:
            fr_add_i64(&self.header[HDR_FEED_ON], d)  # a read-modify-write: see feed_publish
        if self.own_hdr_base != NULL:
            fr_add_i64(&self.own_hdr_base[HDR_FEED_ON], d)
        if d < 0:
            fr_add_i64(&self.header[HDR_FEED_ON], d)
        self.feed_uses += d

    def set_own_ledger(self, own_array, own_header=None):
        """Also book every lease in ``own_array`` (this process's private ledger, same shape as
        the table), so a supervisor can subtract exactly what a dead process held; with the
        ledger's ``own_header``, count there too the feed uses of this picker's indexes."""
        if self.own_hdr_base != NULL:
            fr_add_i64(&self.own_hdr_base[HDR_FEED_ON], -self.feed_uses)
            self.own_hdr = None
            self.own_hdr_base = NULL
        if own_header is not None and own_array is not None:
            if own_header.shape[0] < NHDR:
                raise ValueError(f"the own ledger's header has {own_header.shape[0]} cells, expected {NHDR}")
            self.own_hdr = own_header
            self.own_hdr_base = &self.own_hdr[0]
            fr_add_i64(&self.own_hdr_base[HDR_FEED_ON], self.feed_uses)
        if own_array is None:
            self.own = None
            self.own_base = NULL
            return
        if own_array.shape[0] < self.tab.shape[0] or own_array.shape[1] != NCOLS:
            raise ValueError("the own ledger must have the table's shape")
        self.own = own_array
        self.own_base = &self.own[0, 0]
        self.keep = (self.keep[0], self.keep[1], own_array)

    def set_candidates(self, cands):
        arr = np.ascontiguousarray(cands, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.tab.shape[0]):
            raise IndexError("candidate target out of the table's range")
        self.cands = arr
        self.scratch = np.zeros(2 * arr.shape[0] + 2 * MAX_SLOTS + 1, dtype=np.int64)
        self.coord_n = 0
        if self.cursor >= arr.shape[0]:
            self.cursor = 0
        self._index_setup(arr)
        self._coord_drop()
        self.cidx_ok = (arr.shape[0] >= ix.INDEX_MIN_CANDS and self._plans()
                        and np.unique(arr).shape[0] == arr.shape[0])

    cdef inline bint _plans(self) noexcept:
        # Whether this picker plans with synced replicas (pick_coordinated).
        return (self.kv_fit == MODE_ON or self.demand == MODE_ON
                or (self.kind == KIND_P2C and self.metric == METRIC_LEAST_REQUESTS))

    cdef int _coord_setup(self) except -1:
        # The coordinated index over the candidates (the first synced pick after they are set).
        cdef int64_t size = 1
        cdef int64_t[::1] leaves, nodes, extra, leaf_of
        arr = np.asarray(self.cands)
        while size < arr.shape[0]:
            size <<= 1
        leaves = np.zeros(cx.LEAF * size, dtype=np.int64)
        nodes = np.zeros(cx.CN * 2 * size, dtype=np.int64)
        extra = np.zeros(size, dtype=np.int64)
        leaf_of = np.full(int(arr.max()) + 1, -1, dtype=np.int64)
        np.asarray(leaf_of)[arr] = np.arange(arr.shape[0], dtype=np.int64)
        self.cidx_keep = (leaves, nodes, extra, leaf_of, self.cands)
        self.cidx.demand = self.demand == MODE_ON
        self.cidx.kv = self.kv_fit == MODE_ON
        self.cidx.weight = self.weight
        self.cidx.size = size
        self.cidx.n = arr.shape[0]
        self.cidx.mapped = leaf_of.shape[0]
        self.cidx.leaves = &leaves[0]
        self.cidx.nodes = &nodes[0]
        self.cidx.extra = &extra[0]
        self.cidx.leaf_of = &leaf_of[0]
        self.cidx.tab = &self.tab[0, 0]
        self.cidx.cands = &self.cands[0]
        self.cidx.header = &self.header[0]
        self._feed_use(1)  # writers publish from now on; then the rows are read
        self.cidx.on = True
        cx.coord_rebuild(&self.cidx)
        return 0

    cdef void _coord_drop(self) noexcept:
        if self.cidx.on:
            self.cidx.on = False
            self.cidx_keep = None
            self._feed_use(-1)

    cdef int _index_setup(self, arr) except -1:
        # A load index over the candidates when the pick is a least_requests, demand or KV-fit
        # minimum over enough of them (distinct rows: each leaf must have a row of its own).
        cdef int kind = ix.INDEX_NONE
        cdef int64_t size = 1
        cdef int64_t[::1] nodes, leaf_of
        if self.idx.kind != ix.INDEX_NONE:
            self.idx.kind = ix.INDEX_NONE
            self.idx_keep = None
            self._feed_use(-1)
        if arr.shape[0] >= ix.INDEX_MIN_CANDS:
            if self.kv_fit == MODE_ON:
                kind = ix.INDEX_NONE if self.demand == MODE_ON else ix.INDEX_KV_FIT
            elif self.demand == MODE_ON:
                kind = ix.INDEX_DEMAND
            elif self.kind == KIND_P2C and self.metric == METRIC_LEAST_REQUESTS:
                kind = ix.INDEX_LEAST_REQUESTS
        if kind != ix.INDEX_NONE and np.unique(arr).shape[0] != arr.shape[0]:
            kind = ix.INDEX_NONE
        self.idx.kind = kind
        self.idx_keep = None
        if kind == ix.INDEX_NONE:
            return 0
        while size < arr.shape[0]:
            size <<= 1
        nodes = np.zeros(2 * ix.NODE * size, dtype=np.int64)
        leaf_of = np.full(int(arr.max()) + 1, -1, dtype=np.int64)
        np.asarray(leaf_of)[arr] = np.arange(arr.shape[0], dtype=np.int64)
        self.idx_keep = (nodes, leaf_of, self.cands)
        self.idx.size = size
        self.idx.n = arr.shape[0]
        self.idx.weight = self.weight
        self.idx.mapped = leaf_of.shape[0]
        self.idx.nodes = &nodes[0]
        self.idx.leaf_of = &leaf_of[0]
        self.idx.tab = &self.tab[0, 0]
        self.idx.cands = &self.cands[0]
        self.idx.header = &self.header[0]
        self._feed_use(1)  # writers publish from now on; then the rows are read
        ix.index_rebuild(&self.idx)
        return 0

    cdef int64_t _index_pick(self, int64_t tokens, int64_t need) noexcept nogil:
        # The indexed pick, or the scan when the index disagrees with a row (see index_pick).
        cdef int64_t t = ix.index_pick(&self.idx, &self.rng, need)
        if t != ix.PICK_SCAN:
            return t
        if self.idx.kind == ix.INDEX_KV_FIT:
            return pick_kv_fit(self.tab, self.cands, tokens, need, False, self.weight, &self.rng)
        if self.idx.kind == ix.INDEX_DEMAND:
            return pick_demand(self.tab, self.cands, tokens, self.weight, &self.rng)
        return pick_p2c(self.tab, self.cands, self.metric, &self.rng)

    def indexed_ties(self, int64_t need=0):
        """What the load index draws the next pick from (after reading the feed), in candidate
        order: the tied minimum; for KV fit those where ``need`` fits, or if none does, the most
        free KV.  [] when none is eligible; None when the picker keeps no index."""
        cdef int64_t best[4]
        cdef int64_t leaf
        if self.idx.kind == ix.INDEX_NONE:
            return None
        ix.index_drain(&self.idx)
        best[0] = best[1] = best[2] = best[3] = 0
        if self.idx.kind == ix.INDEX_KV_FIT:
            ix.fit_search(&self.idx, need, best, -1)
        return [int(self.cands[leaf]) for leaf in range(self.idx.n)
                if ix.index_is_tie(&self.idx, leaf, need, best)]

    @property
    def indexed(self):
        """The load index's key: least_requests, demand, kv_fit, or None (the picker scans)."""
        return {ix.INDEX_LEAST_REQUESTS: "least_requests", ix.INDEX_DEMAND: "demand",
                ix.INDEX_KV_FIT: "kv_fit"}.get(self.idx.kind)

    def coordinated_plan(self, int64_t tokens=0, int64_t need=0, int64_t n=2, int64_t slot=0,
                         bint strict=False):
        """The synced replicas' plan from the coordinated index (built if need be; nothing is
        booked): (this replica's target, the n placements), as ``_policy.coordinated``; (-1,
        []) when none is eligible; None when the picker keeps no such index (the scan plans)
        or its leaves kept disagreeing with their rows (the pick then scans)."""
        cdef int64_t m = self.cands.shape[0], t
        if not self.cidx_ok:
            return None
        if n < 1 or n > MAX_SLOTS or not 0 <= slot < n:
            raise ValueError(f"need 1 <= n <= {MAX_SLOTS} and 0 <= slot < n")
        if self.cidx.on:
            cx.coord_drain(&self.cidx)
        else:
            self._coord_setup()
        t = cx.coord_plan(&self.cidx, tokens, need, n, slot, strict, &self.scratch[2 * m], False)
        if t < 0:
            return (-1, []) if t == -1 else None
        return t, [int(x) for x in self.scratch[2 * m:2 * m + n]]

    @property
    def coordinated_indexed(self):
        """Whether the coordinated index is built (a synced pick over enough candidates)."""
        return bool(self.cidx.on)

    @property
    def coordinated_idle(self):
        """The coordinated index's idle test (after reading the feed); None when not built."""
        if not self.cidx.on:
            return None
        cx.coord_drain(&self.cidx)
        return bool(cx.coord_idle(&self.cidx))

    @property
    def coordinated_rebuilds(self):
        """Times the coordinated index was built from the rows."""
        return self.cidx.rebuilds

    @property
    def index_rebuilds(self):
        """Times the load index was built from the rows (set, or fallen behind the feed)."""
        return self.idx.rebuilds

    def set_ring(self, hashes, targets):
        h = np.ascontiguousarray(hashes, dtype=np.uint64)
        t = np.ascontiguousarray(targets, dtype=np.int64)
        if h.shape != t.shape or h.ndim != 1:
            raise ValueError("ring hashes and targets differ in length")
        if t.size and (t.min() < 0 or t.max() >= self.tab.shape[0]):
            raise IndexError("ring target out of the table's range")
        self.ring_hash = h
        self.ring_target = t

    cdef int64_t _legacy(self, const unsigned char *key, Py_ssize_t klen) noexcept nogil:
        if self.kind == KIND_P2C:
            if self.idx.kind == ix.INDEX_LEAST_REQUESTS:
                return self._index_pick(0, 0)
            return pick_p2c(self.tab, self.cands, self.metric, &self.rng)
        if self.kind == KIND_ROUND_ROBIN:
            return pick_round_robin(self.tab, self.cands, &self.cursor)
        if self.kind == KIND_RING and key != NULL:
            return pick_ring(self.tab, self.ring_hash, self.ring_target, hash_bytes(key, klen))
        return pick_random(self.tab, self.cands, &self.rng)

    cpdef int64_t pick(self, int64_t tokens=0, bytes key=None, int64_t out_tokens=0):
        """The target the policy chooses now (no booking), or -1.

        With KV fit on, the candidates are first narrowed to the ranks where this request's
        input + ``out_tokens`` + the configured reserve fit in estimated free KV (see
        ``_policy.kv_free``); in shadow the usual pick is dispatched and agreement counted."""
        return self._pick(tokens, key, out_tokens, False)

    cdef int64_t _pick(self, int64_t tokens, bytes key, int64_t out_tokens, bint booking) except? -9:
        # booking: acquire() books what a coordinated plan placed (its charges may stay).
        cdef const unsigned char *k = NULL
        cdef Py_ssize_t klen = 0
        cdef int64_t a, b, f = -2, n, need = tokens + out_tokens + self.kv_reserve
        if key is not None:
            k = key
            klen = len(key)
        self.coord_n = 0
        n = fr_load_i64(&self.header[HDR_REPLICAS])
        if n > 1 and self.cidx_ok:
            if self.cidx.on:
                cx.coord_drain(&self.cidx)
            else:
                self._coord_setup()
            if not cx.coord_idle(&self.cidx):
                return self._coordinated(tokens, need, n, booking)
        elif n > 1 and self.cands.shape[0] > 0 and self._plans() and not self._idle():
            return self._coordinated(tokens, need, n, False)
        elif self.cidx.on:
            self._coord_drop()  # alone again: the writers need not publish for it
        if self.idx.kind == ix.INDEX_KV_FIT:
            f = self._index_pick(tokens, need)
            if f == -2:
                self.kv_fallback += 1
            else:
                return f
        elif self.kv_fit != 0:
            f = pick_kv_fit(self.tab, self.cands, tokens, tokens + out_tokens + self.kv_reserve,
                            self.demand == MODE_ON, self.weight, &self.rng)
            if f == -2:
                self.kv_fallback += 1
            elif self.kv_fit == MODE_ON:
                return f
        if self.demand == MODE_ON:
            if self.idx.kind == ix.INDEX_DEMAND:
                a = self._index_pick(tokens, 0)
            else:
                a = pick_demand(self.tab, self.cands, tokens, self.weight, &self.rng)
            self._count_kv(a, f, tokens + out_tokens + self.kv_reserve)
            return a
        a = self._legacy(k, klen)
        self._count_kv(a, f, tokens + out_tokens + self.kv_reserve)
        if self.demand == MODE_SHADOW:
            b = pick_demand(self.tab, self.cands, tokens, self.weight, &self.rng)
            self.last_legacy = a
            self.last_demand = b
            if a == b:
                self.shadow_agree += 1
            else:
                self.shadow_disagree += 1
        return a

    cdef bint _idle(self) noexcept:
        # Nothing in flight on any candidate, here or at the others, and no placement of theirs
        # estimated: there is no burst to share out.  The plan's shared tie order would then
        # send every request of a replica whose peers are idle to the same rank (its slot's,
        # whenever all loads are equal), so the pick is this replica's own, exact ties broken
        # by its own random source.
        cdef Py_ssize_t k
        cdef int64_t *row
        for k in range(self.cands.shape[0]):
            row = &self.tab[self.cands[k], 0]
            if (fr_load_i64(&row[COL_IN_FLIGHT]) or fr_load_i64(&row[COL_OTHERS_IN_FLIGHT])
                    or fr_load_i64(&row[COL_OTHERS_EST])):
                return False
        return True

    cdef int64_t _coordinated(self, int64_t tokens, int64_t need, int64_t n, bint booking) noexcept:
        # Synced replicas (see pick_coordinated): this replica's place in the sequence of the
        # next n placements; acquire() books the rest as the others' estimate.
        cdef int64_t slot = fr_load_i64(&self.header[HDR_REPLICA_SLOT])
        cdef int64_t m = self.cands.shape[0], t
        cdef int64_t tick = fr_load_i64(&self.header[HDR_SYNC_TICKS])
        # Later picks on the same view are a burst, planned with the others' earlier places
        # already booked: each replica keeps its exact place.  The first pick after a sync may
        # be the only one before the next, and then stays on the least-loaded level; unless
        # this replica's picks have lately come in bursts (then so, most likely, do the
        # others': a load balancer in front hands every replica the same shape of traffic),
        # when the others are taking their places of the same plan right now.
        cdef bint later = tick == self.coord_tick
        cdef bint strict
        self.coord_burst += ((<int64_t>later << 10) - self.coord_burst) >> 4
        strict = later or self.coord_burst >= BURSTY_SHARE
        self.coord_tick = tick
        if n > MAX_SLOTS:
            n = MAX_SLOTS
        if slot < 0 or slot >= n:
            slot = slot % n if slot > 0 else 0
        t = cx.COORD_SCAN
        if self.cidx.on:
            t = cx.coord_plan(&self.cidx, tokens, need, n, slot, strict, &self.scratch[2 * m], booking)
        if t == cx.COORD_SCAN:
            t = pick_coordinated(self.tab, self.cands, tokens, need, self.demand == MODE_ON,
                                 self.weight, self.kv_fit == MODE_ON, n, slot, strict,
                                 &self.scratch[0], &self.scratch[2 * m])
        if t >= 0:
            self.coord_n = n
            self.coord_slot = self.scratch[2 * m + 2 * n]   # the place it took
            # A lone pick (not a burst) books the others' places as requests only: should they
            # not be placing anything now, phantom input tokens would hide free KV on those
            # ranks from KV fit until the next publication (with tight KV, it then sends work
            # to ranks that are fuller in fact).
            self.coord_tokens = strict
        return t

    cdef void _book_estimate(self, int64_t tokens) noexcept:
        # The placements the other replicas are expected to make now, counted until the next
        # sync replaces them with what they published.
        cdef int64_t m = self.cands.shape[0], s, t
        cdef int64_t *row
        for s in range(self.coord_n):
            if s == self.coord_slot:
                continue
            t = self.scratch[2 * m + s]
            row = &self.tab[t, 0]
            fr_add_i64(&row[COL_OTHERS_EST], 1)
            if self.coord_tokens:
                fr_add_i64(&row[COL_OTHERS_EST_TOKENS], tokens)
            feed_publish(&self.header[0], t)
        self.coordinated_picks += 1
        self.coord_n = 0

    cdef inline void _count_kv(self, int64_t dispatched, int64_t fit, int64_t need) noexcept:
        # Shadow agreement: the dispatched target is one KV fit would also accept (it fits, or
        # it is KV fit's own choice).  Comparing exact picks would count random tie-breaks
        # between equally good ranks as disagreement.
        if self.kv_fit == MODE_SHADOW and fit >= 0 and dispatched >= 0:
            if fit == dispatched or kv_free(self.tab, dispatched) >= need:
                self.kv_agree += 1
            else:
                self.kv_disagree += 1

    def acquire(self, int64_t tokens=0, bytes key=None, text=None, int64_t out_tokens=0):
        """Pick and book in one call; returns a Lease, or None when no target is eligible.
        ``text`` is accepted for call compatibility with text-aware policies and ignored."""
        cdef int64_t t = self._pick(tokens, key, out_tokens, True)
        cdef Lease lease
        if t < 0:
            return None
        if self.coord_n:
            self._book_estimate(tokens)
        lease = _new_lease(self.tab, &self.header[0], t, tokens, self.keep, self.own_base)
        lease._until_answer = self.tokens_until_answer
        return lease

    def book_target(self, int64_t t, int64_t tokens=0):
        """Book a target chosen elsewhere (cache_aware picks in Python); returns its Lease."""
        cdef Lease lease
        if t < 0 or t >= self.tab.shape[0]:
            raise IndexError(f"target {t} out of range")
        lease = _new_lease(self.tab, &self.header[0], t, tokens, self.keep, self.own_base)
        lease._until_answer = self.tokens_until_answer
        return lease

    @property
    def candidates(self):
        return np.asarray(self.cands).copy()
