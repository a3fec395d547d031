"""The ``manual`` policy (sglang-router 0.3.2): sticky routing keys, compiled.

A request's routing key (``X-SMG-Routing-Key``, then ``--routing-key-headers``) is hashed once
(``_policy.hash64``'s FNV-1a + splitmix) and looked up in an open-addressing table owned by this
process: key hash -> (target row, last use).  A key seen before goes to its target while that
target is still a candidate and eligible; a new key, or one whose target left or went unhealthy,
is (re)assigned by ``--assignment-mode``:

* ``random``:   uniform over the eligible candidates;
* ``min_load``: fewest in-flight requests (the table's COL_IN_FLIGHT), ties at random;
* ``min_group``: fewest keys currently assigned, ties at random.

A request without a key is placed by the same rule and not remembered.  Keys idle for longer
than ``max_idle`` seconds are dropped by a sweep that runs from the pick itself at most once per
``sweep_every`` seconds (no timer, no thread); the sweep also drops keys whose target is no
longer a candidate.  At most ``max_keys`` keys are kept (``--max-manual-keys``): a new key
beyond it first evicts the least recently used eighth (``evicted`` counts them), so memory is
bounded whatever the clients send within ``max_idle``.  The sweep rebuilds the table (O(capacity)), which keeps deletion trivial for
linear probing and bounds memory to ~2x the live keys.

The table is per process: under ``--workers N`` each proxy process keeps its own keys (a key is
sticky within a process).  ``fastroute.core.reference.ManualKeys`` is the twin: same hash, same
RNG draws, same sweep schedule, compared pick for pick by the differential test.
"""
from libc.stdint cimport int64_t, uint64_t
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from fastroute.core._atomic cimport fr_load_i64
from fastroute.core._layout cimport COL_IN_FLIGHT, NCOLS, row_eligible
from fastroute.core._random cimport mix64, rng_below, reservoir_step
import numpy as np

# Assignment modes, in --assignment-mode order (fastroute.names.ASSIGNMENT_MODE_CODE).
cdef enum:
    MODE_RANDOM = 0
    MODE_MIN_LOAD = 1
    MODE_MIN_GROUP = 2
    MIN_CAPACITY = 64       # slots; a power of two (the probe masks with capacity - 1)


cdef inline uint64_t _key_hash(const unsigned char *data, Py_ssize_t n) noexcept nogil:
    # FNV-1a + splitmix, as _policy.hash_bytes; 0 marks an empty slot, so a key hashing to 0
    # is stored as 1 (one extra collision in 2^64).
    cdef uint64_t h = <uint64_t>0xCBF29CE484222325
    cdef Py_ssize_t i
    for i in range(n):
        h = (h ^ data[i]) * <uint64_t>0x100000001B3
    h = mix64(h)
    return h if h != 0 else 1


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9


cdef inline bint _is_candidate(const int64_t[::1] cands, int64_t t) noexcept nogil:
    cdef Py_ssize_t i
    for i in range(cands.shape[0]):
        if cands[i] == t:
            return True
    return False


cdef class KeyTable:
    """Routing key -> target map with assignment by mode; see the module docstring."""

    cdef uint64_t[::1] keys          # key hash per slot, 0 = empty
    cdef int64_t[::1] owner          # target row per slot
    cdef double[::1] used            # last use per slot (monotonic seconds)
    cdef int64_t[::1] per_target     # keys held per table row (min_group's score)
    cdef uint64_t rng
    cdef readonly int mode
    cdef readonly double max_idle
    cdef readonly double sweep_every
    cdef double next_sweep
    cdef readonly Py_ssize_t count
    cdef readonly int64_t reassigned  # keys moved because their target left or went unhealthy
    cdef readonly Py_ssize_t max_keys  # bound on stored keys (0: none); LRU eviction past it
    cdef readonly int64_t evicted     # keys dropped by that bound
    # The table and candidates of pick_bound, held as memoryviews so that the per-request call
    # does not pay two buffer acquisitions (bind() sets them when the candidates change).
    cdef const int64_t[:, ::1] btab
    cdef const int64_t[::1] bcands
    cdef bint bound

    def __init__(self, int64_t rows, int mode, double max_idle, double sweep_every, uint64_t seed,
                 Py_ssize_t max_keys=0):
        if mode < MODE_RANDOM or mode > MODE_MIN_GROUP:
            raise ValueError(f"unknown assignment mode code {mode}")
        if rows < 1:
            raise ValueError("rows must be >= 1")
        self.mode = mode
        self.max_idle = max_idle
        self.sweep_every = sweep_every
        self.next_sweep = 0.0
        self.rng = seed
        self.per_target = np.zeros(rows, dtype=np.int64)
        self._alloc(MIN_CAPACITY)
        self.count = 0
        self.reassigned = 0
        self.bound = False
        if max_keys < 0:
            raise ValueError("max_keys must be >= 0")
        self.max_keys = max_keys
        self.evicted = 0

    cdef void _alloc(self, Py_ssize_t cap):
        self.keys = np.zeros(cap, dtype=np.uint64)
        self.owner = np.zeros(cap, dtype=np.int64)
        self.used = np.zeros(cap, dtype=np.float64)

    cdef Py_ssize_t _slot(self, uint64_t h) noexcept nogil:
        # The slot holding h, or the empty slot where it would go (the table is never full).
        cdef Py_ssize_t mask = self.keys.shape[0] - 1
        cdef Py_ssize_t i = <Py_ssize_t>(h & <uint64_t>mask)
        while self.keys[i] != 0 and self.keys[i] != h:
            i = (i + 1) & mask
        return i

    cdef void _grow(self, Py_ssize_t cap):
        cdef uint64_t[::1] ok = self.keys
        cdef int64_t[::1] oo = self.owner
        cdef double[::1] ou = self.used
        cdef Py_ssize_t i, s
        self._alloc(cap)
        for i in range(ok.shape[0]):
            if ok[i] != 0:
                s = self._slot(ok[i])
                self.keys[s] = ok[i]
                self.owner[s] = oo[i]
                self.used[s] = ou[i]

    cdef int64_t _assign(self, const int64_t[:, ::1] tab, const int64_t[::1] cands) noexcept nogil:
        cdef Py_ssize_t k
        cdef int64_t t, best = -1, best_score = 0, score, ties = 0, m = 0, nth
        if self.mode == MODE_RANDOM:
            for k in range(cands.shape[0]):
                if row_eligible(&tab[cands[k], 0]):
                    m += 1
            if m == 0:
                return -1
            nth = <int64_t>rng_below(&self.rng, <uint64_t>m)
            for k in range(cands.shape[0]):
                t = cands[k]
                if row_eligible(&tab[t, 0]):
                    if nth == 0:
                        return t
                    nth -= 1
            return -1
        for k in range(cands.shape[0]):
            t = cands[k]
            if not row_eligible(&tab[t, 0]):
                continue
            if self.mode == MODE_MIN_LOAD:
                score = fr_load_i64(&tab[t, COL_IN_FLIGHT])
            else:
                score = self.per_target[t]
            if best < 0 or score < best_score:
                best, best_score, ties = t, score, 1
            elif score == best_score and reservoir_step(&self.rng, &ties):
                best = t
        return best

    cdef int64_t _pick(self, const int64_t[:, ::1] tab, const int64_t[::1] cands,
                       const unsigned char *key, Py_ssize_t n, bint has_key,
                       double now) except? -2:
        cdef Py_ssize_t s
        cdef uint64_t h
        cdef int64_t t, old
        if now >= self.next_sweep:
            self._sweep(cands, now)
        if not has_key:
            return self._assign(tab, cands)
        h = _key_hash(key, n)
        s = self._slot(h)
        if self.keys[s] == h:
            old = self.owner[s]
            if _is_candidate(cands, old) and row_eligible(&tab[old, 0]):
                self.used[s] = now
                return old
            t = self._assign(tab, cands)
            if t < 0:
                return -1
            self.per_target[old] -= 1
            self.per_target[t] += 1
            self.owner[s] = t
            self.used[s] = now
            self.reassigned += 1
            return t
        t = self._assign(tab, cands)
        if t < 0:
            return -1
        if self.max_keys > 0 and self.count >= self.max_keys:
            self._evict()
            s = self._slot(h)
        self.keys[s] = h
        self.owner[s] = t
        self.used[s] = now
        self.per_target[t] += 1
        self.count += 1
        if self.count * 2 > self.keys.shape[0]:
            self._grow(self.keys.shape[0] * 2)
        return t

    cdef int _evict(self) except -1:
        """The table is at max_keys: drop the least recently used eighth (at least one key),
        oldest last use first, ties by key hash (the twin's order), and rebuild the table.
        O(n log n) once per max_keys/8 new keys: amortised O(log n) per new key."""
        keys = np.asarray(self.keys)
        used = np.asarray(self.used)
        owner = np.asarray(self.owner)
        live = np.flatnonzero(keys)
        m = max(1, self.max_keys // 8)
        order = np.lexsort((keys[live], used[live]))
        drop = live[order[:m]]
        np.subtract.at(np.asarray(self.per_target), owner[drop], 1)
        keys[drop] = 0
        self.count -= drop.shape[0]
        self.evicted += drop.shape[0]
        self._grow(self.keys.shape[0])      # rehash what is left (linear probing, no tombstones)
        return 0

    cdef void _sweep(self, const int64_t[::1] cands, double now):
        """Drop idle keys and keys whose target is no longer a candidate; rebuild the table."""
        cdef uint64_t[::1] ok = self.keys
        cdef int64_t[::1] oo = self.owner
        cdef double[::1] ou = self.used
        cdef Py_ssize_t i, s, live = 0, cap = MIN_CAPACITY
        self.next_sweep = now + self.sweep_every
        for i in range(ok.shape[0]):
            if ok[i] != 0 and (self.max_idle <= 0 or now - ou[i] <= self.max_idle) \
                    and _is_candidate(cands, oo[i]):
                live += 1
        while live * 2 > cap:
            cap *= 2
        self.per_target[:] = 0
        self._alloc(cap)
        for i in range(ok.shape[0]):
            if ok[i] != 0 and (self.max_idle <= 0 or now - ou[i] <= self.max_idle) \
                    and _is_candidate(cands, oo[i]):
                s = self._slot(ok[i])
                self.keys[s] = ok[i]
                self.owner[s] = oo[i]
                self.used[s] = ou[i]
                self.per_target[oo[i]] += 1
        self.count = live

    def _check(self, const int64_t[:, ::1] tab, const int64_t[::1] cands):
        cdef Py_ssize_t k
        if tab.shape[1] != NCOLS:
            raise ValueError(f"table has {tab.shape[1]} columns, the layout has {NCOLS}")
        for k in range(cands.shape[0]):
            if cands[k] < 0 or cands[k] >= tab.shape[0] or cands[k] >= self.per_target.shape[0]:
                raise IndexError(f"candidate {cands[k]} out of range")

    def pick(self, const int64_t[:, ::1] tab, const int64_t[::1] cands, bytes key, double now):
        """The target for ``key`` (None: a keyless request) at time ``now``; -1 if none is
        eligible.  Checks its arguments (tests, the differential comparison)."""
        self._check(tab, cands)
        if key is None:
            return self._pick(tab, cands, NULL, 0, False, now)
        return self._pick(tab, cands, <const unsigned char *>key, len(key), True, now)

    def bind(self, const int64_t[:, ::1] tab, const int64_t[::1] cands):
        """Fix the table and candidates ``pick_bound`` uses (checked here, once), and sweep out
        keys whose target is no longer a candidate."""
        self._check(tab, cands)
        self.btab = tab
        self.bcands = cands
        self.bound = True
        self._sweep(cands, _now())

    def pick_bound(self, bytes key):
        """``pick`` over the bound table and candidates at the monotonic clock: the per-request
        call of the Group."""
        if not self.bound:
            raise RuntimeError("bind() first")
        if key is None:
            return self._pick(self.btab, self.bcands, NULL, 0, False, _now())
        return self._pick(self.btab, self.bcands, <const unsigned char *>key, len(key), True, _now())

    def sweep(self, const int64_t[::1] cands, double now):
        """Run the sweep now (tests; the Group also calls it when its candidates change)."""
        self._sweep(cands, now)

    def owner_of(self, bytes key):
        """The target row ``key`` is assigned to, or -1 (tests)."""
        cdef uint64_t h = _key_hash(<const unsigned char *>key, len(key))
        cdef Py_ssize_t s = self._slot(h)
        return self.owner[s] if self.keys[s] == h else -1

    def keys_of(self, int64_t t):
        """Keys currently assigned to target row ``t``."""
        return int(self.per_target[t])

    @property
    def capacity(self):
        return self.keys.shape[0]
