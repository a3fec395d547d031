"""Compiled policy kernels over the shared target table.

Every kernel is a pure function: it reads counters through the atomics header, never writes the
table (booking is the ledger's job), and breaks ties at random from explicit RNG state so that no
rank wins ties by being first.  ``fastroute.core.reference`` holds a NumPy twin of each kernel that
consumes the RNG identically; the differential tests compare them pick for pick.
"""
from libc.stdint cimport int64_t, uint64_t, INT64_MIN
from fastroute.core._atomic cimport fr_load_i64
from fastroute.core._layout cimport (
    COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_POLLED_RUNNING, COL_POLLED_WAITING, COL_POLLED_TOKENS,
    COL_POLLED_AT, COL_HEALTHY, COL_PICKS, COL_CIRCUIT, COL_POLLED_MAX_TOKENS, COL_ALLOCATED,
    COL_TOKENS_AT_POLL, COL_CB_FAILS, COL_CB_OKS, COL_CB_OPENED_AT, COL_OTHERS_OPEN,
    COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS, COL_OTHERS_EST, COL_OTHERS_EST_TOKENS, COL_ORDER_KEY,
    NCOLS, HDR_MAGIC, HDR_CAPACITY, HDR_UNDERFLOWS, HDR_GENERATION, HDR_REPLICAS, HDR_REPLICA_SLOT,
    HDR_SYNC_TICKS, NHDR, plan_level, plan_place, HDR_FEED_ON, HDR_FEED_AT, HDR_FEED, HDR_FEED_SLOTS, HDR_FEED_ROW_BITS,
    CIRCUIT_CLOSED, CIRCUIT_OPEN, CIRCUIT_HALF_OPEN, row_eligible, row_requests, row_tokens,
    row_pending, row_kv_free, COL_POLLED_UNCACHED, COL_POLLED_KV_QUEUE, COL_POLLED_MAX_RUNNING,
)
from fastroute.core._random cimport mix64, rng_below, reservoir_step
import numpy as np

cdef enum:
    # Draws a power-of-two pick makes for each of its two candidates before it scans.
    P2C_TRIES = 8


cdef uint64_t hash_bytes(const unsigned char *data, Py_ssize_t n) noexcept nogil:
    # FNV-1a for speed, then the splitmix finaliser so that similar keys land far apart on the ring.
    cdef uint64_t h = <uint64_t>0xCBF29CE484222325
    cdef Py_ssize_t i
    for i in range(n):
        h = (h ^ data[i]) * <uint64_t>0x100000001B3
    return mix64(h)


cdef inline int64_t _nth_eligible(const int64_t[:, ::1] tab, const int64_t[::1] cands,
                                  int64_t nth) noexcept nogil:
    cdef Py_ssize_t i
    cdef int64_t seen = 0
    for i in range(cands.shape[0]):
        if row_eligible(&tab[cands[i], 0]):
            if seen == nth:
                return cands[i]
            seen += 1
    return -1


cdef inline int64_t _count_eligible(const int64_t[:, ::1] tab, const int64_t[::1] cands) noexcept nogil:
    cdef Py_ssize_t i
    cdef int64_t m = 0
    for i in range(cands.shape[0]):
        if row_eligible(&tab[cands[i], 0]):
            m += 1
    return m


cdef int64_t pick_round_robin(const int64_t[:, ::1] tab, const int64_t[::1] cands,
                              int64_t *cursor) noexcept nogil:
    cdef Py_ssize_t n = cands.shape[0], k
    cdef int64_t c
    if n == 0:
        return -1
    for k in range(n):
        c = (cursor[0] + k) % n
        if row_eligible(&tab[cands[c], 0]):
            cursor[0] = (c + 1) % n
            return cands[c]
    return -1


cdef int64_t pick_random(const int64_t[:, ::1] tab, const int64_t[::1] cands,
                         uint64_t *rng) noexcept nogil:
    cdef int64_t m = _count_eligible(tab, cands)
    if m == 0:
        return -1
    return _nth_eligible(tab, cands, <int64_t>rng_below(rng, <uint64_t>m))


cdef int64_t pick_p2c(const int64_t[:, ::1] tab, const int64_t[::1] cands, int metric,
                      uint64_t *rng) noexcept nogil:
    cdef int64_t m, i, j, a, b, t, best, best_req, best_tok, req, tok
    cdef int64_t ties
    cdef bint any_polled
    cdef Py_ssize_t k
    if metric == METRIC_LEAST_REQUESTS:
        # Every eligible candidate; only those the monitor has polled, unless none has been.
        any_polled = False
        for k in range(cands.shape[0]):
            t = cands[k]
            if row_eligible(&tab[t, 0]) and fr_load_i64(&tab[t, COL_POLLED_AT]) >= 0:
                any_polled = True
                break
        best = -1
        best_req = 0
        best_tok = 0
        ties = 0
        for k in range(cands.shape[0]):
            t = cands[k]
            if not row_eligible(&tab[t, 0]):
                continue
            if any_polled and fr_load_i64(&tab[t, COL_POLLED_AT]) < 0:
                continue
            req = row_requests(&tab[t, 0])
            tok = fr_load_i64(&tab[t, COL_POLLED_TOKENS]) if any_polled else 0
            if best < 0 or req < best_req or (req == best_req and tok < best_tok):
                best, best_req, best_tok, ties = t, req, tok, 1
            elif req == best_req and tok == best_tok:
                # Reservoir sampling over the tied minimum: each of N tied targets wins 1/N.
                if reservoir_step(rng, &ties):
                    best = t
        return best

    # Two distinct candidates drawn at random without scanning: each draw takes a random slot
    # and keeps it if eligible (a few tries); a cost independent of the candidate count when
    # most are eligible.  Should a draw miss every try, the pair is drawn again from a scan.
    # Either way the pair is uniform over the eligible ones (a draw that succeeds is uniform
    # over them, and the second's chance of success does not depend on the first's result).
    if cands.shape[0] >= 2:
        i = _sample_eligible(tab, cands, -1, rng)
        if i >= 0:
            j = _sample_eligible(tab, cands, i, rng)
            if j >= 0:
                return _p2c_pair(tab, cands[i], cands[j], metric)
    m = _count_eligible(tab, cands)
    if m == 0:
        return -1
    if m == 1:
        return _nth_eligible(tab, cands, 0)
    # Two distinct random candidates; a is as likely to be either, so "a wins ties" is random.
    i = <int64_t>rng_below(rng, <uint64_t>m)
    j = <int64_t>rng_below(rng, <uint64_t>(m - 1))
    if j >= i:
        j += 1
    a = _nth_eligible(tab, cands, i)
    b = _nth_eligible(tab, cands, j)
    if a < 0 or b < 0:          # health changed between the two scans
        return a if a >= 0 else b
    return _p2c_pair(tab, a, b, metric)


cdef inline int64_t _sample_eligible(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t skip,
                                     uint64_t *rng) noexcept nogil:
    # The slot of a random eligible candidate other than slot ``skip`` (-1: none skipped), in at
    # most P2C_TRIES draws, or -1.  Every draw is uniform over the slots left.
    cdef int64_t k, i
    cdef uint64_t span = <uint64_t>cands.shape[0] - (1 if skip >= 0 else 0)
    for k in range(P2C_TRIES):
        i = <int64_t>rng_below(rng, span)
        if skip >= 0 and i >= skip:
            i += 1
        if row_eligible(&tab[cands[i], 0]):
            return i
    return -1


cdef inline int64_t _p2c_pair(const int64_t[:, ::1] tab, int64_t a, int64_t b, int metric) noexcept nogil:
    # The less loaded of a and b by the metric; a, drawn first, wins exact ties.
    cdef int64_t ra = row_requests(&tab[a, 0]), rb = row_requests(&tab[b, 0])
    cdef bint pa = fr_load_i64(&tab[a, COL_POLLED_AT]) >= 0
    cdef bint pb = fr_load_i64(&tab[b, COL_POLLED_AT]) >= 0
    cdef int64_t ta = fr_load_i64(&tab[a, COL_POLLED_TOKENS])
    cdef int64_t tb = fr_load_i64(&tab[b, COL_POLLED_TOKENS])
    if metric == METRIC_REQUESTS:
        if ra != rb:
            return a if ra < rb else b
        if pa and pb and ta != tb:
            return a if ta < tb else b
        return a
    # METRIC_TOKENS: polled tokens when both are known and differ, else in-flight requests.
    if pa and pb and ta != tb:
        return a if ta < tb else b
    if ra != rb:
        return a if ra < rb else b
    return a


cdef inline int64_t demand_cost(const int64_t *row, int64_t tokens, int64_t weight) noexcept nogil:
    # Decode input demand: in-flight input tokens + this request's tokens + weight x requests
    # held (all replicas: this host's exact counts plus the others' last published ones).
    return row_pending(row) + tokens + weight * row_requests(row)


cdef int64_t pick_demand(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens,
                         int64_t weight, uint64_t *rng) noexcept nogil:
    cdef int64_t best = -1, best_cost = 0, cost, t, ties = 0
    cdef Py_ssize_t k
    for k in range(cands.shape[0]):
        t = cands[k]
        if not row_eligible(&tab[t, 0]):
            continue
        cost = demand_cost(&tab[t, 0], tokens, weight)
        if best < 0 or cost < best_cost:
            best, best_cost, ties = t, cost, 1
        elif cost == best_cost:
            if reservoir_step(rng, &ties):
                best = t
    return best


cdef int64_t pick_ring(const int64_t[:, ::1] tab, const uint64_t[::1] ring_hash,
                       const int64_t[::1] ring_target, uint64_t key) noexcept nogil:
    # First ring point at or after the key (lower bound), then clockwise to the first eligible target.
    cdef Py_ssize_t n = ring_hash.shape[0], lo = 0, hi = n, mid, k
    cdef int64_t t
    if n == 0:
        return -1
    while lo < hi:
        mid = (lo + hi) >> 1
        if ring_hash[mid] < key:
            lo = mid + 1
        else:
            hi = mid
    for k in range(n):
        t = ring_target[(lo + k) % n]
        if row_eligible(&tab[t, 0]):
            return t
    return -1


cdef int64_t kv_free(const int64_t[:, ::1] tab, int64_t t) noexcept nogil:
    """Estimated free KV tokens of a rank now, or INT64_MIN when its capacity is unknown
    (``_layout.row_kv_free``)."""
    return row_kv_free(&tab[t, 0])


cdef inline int64_t eligible_free(const int64_t[:, ::1] tab, int64_t t) noexcept nogil:
    # KV fit's view of a candidate: its estimated free KV tokens, or INT64_MIN when it is not
    # eligible or its capacity is unknown (such a candidate neither fits nor is the roomiest).
    if not row_eligible(&tab[t, 0]):
        return INT64_MIN
    return kv_free(tab, t)


cdef int64_t pick_kv_fit(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens,
                         int64_t need, bint use_demand, int64_t weight,
                         uint64_t *rng) noexcept nogil:
    """Among the ranks where ``need`` more KV tokens fit, the least-requests pick (ties: more free
    KV, then random) or, with ``use_demand``, the demand-cost pick.  When no polled rank fits,
    the rank with the most free KV (ties random).  Ranks of unknown capacity are never treated
    as empty; if no rank has a known capacity, -2 tells the caller to use its usual policy."""
    cdef int64_t best = -1, best_a = 0, best_b = 0, a, b, t, free, ties = 0
    cdef int64_t room = -1, room_free = 0, room_ties = 0
    cdef bint known = False
    cdef Py_ssize_t k
    for k in range(cands.shape[0]):
        t = cands[k]
        free = eligible_free(tab, t)
        if free == INT64_MIN:
            continue
        known = True
        # fallback candidate: most free KV
        if room < 0 or free > room_free:
            room, room_free, room_ties = t, free, 1
        elif free == room_free:
            if reservoir_step(rng, &room_ties):
                room = t
        if free < need:
            continue
        if use_demand:
            a = demand_cost(&tab[t, 0], tokens, weight)
            b = 0
        else:
            a = row_requests(&tab[t, 0])
            b = -free
        if best < 0 or a < best_a or (a == best_a and b < best_b):
            best, best_a, best_b, ties = t, a, b, 1
        elif a == best_a and b == best_b:
            if reservoir_step(rng, &ties):
                best = t
    if not known:
        return -2
    return best if best >= 0 else room


# Cost level of a placement where nothing fits (above every cost of a fitting one).


cdef int64_t pick_coordinated(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens,
                              int64_t need, bint use_demand, int64_t weight, bint kv, int64_t n,
                              int64_t slot, bint strict, int64_t *extra,
                              int64_t *picks) noexcept nogil:
    """Synced replicas' pick: the next ``n`` placements as one router would make them from the
    shared view, this replica taking placement ``slot`` (the others are expected to take the
    rest; the caller books those as their estimate).  Each placement is the least-requests
    (``use_demand``: demand-cost) candidate given the placements before it, among the ranks where
    ``need`` KV tokens fit when ``kv`` (none fits: the most free KV); ties go to the smaller
    shared order key, so every replica computes the same sequence and they fill different ranks
    instead of all sending a burst to the same least-loaded ones.  This replica's place is
    ``slot`` when ``strict`` (a later pick of a burst, planned with the others' earlier places
    already counted), else ``slot`` modulo the number of placements as good as the first (the
    first pick after a sync, which may well be the only one: it never takes a rank above the
    least-loaded level for the others' sake).  ``extra`` is scratch of 2 x candidates;
    ``picks[0..n)`` receives the sequence (candidate rows), ``picks[n..2n)`` each placement's
    cost level, ``picks[2n]`` the index of this replica's own.  -1 when nothing is eligible."""
    cdef Py_ssize_t m = cands.shape[0], k, best
    cdef int64_t s, t, r, cost, free, key, best_cost = 0, best_key = 0, best_free = 0
    cdef bint known = False, fits, best_fits = False, better
    for k in range(2 * m):
        extra[k] = 0
    if kv:
        for k in range(m):
            if eligible_free(tab, cands[k]) != INT64_MIN:
                known = True
                break
    for s in range(n):
        best = -1
        for k in range(m):
            t = cands[k]
            if not row_eligible(&tab[t, 0]):
                continue
            fits = True
            free = 0
            if known:
                free = kv_free(tab, t)
                if free == INT64_MIN:
                    continue
                free -= extra[m + k]
                fits = free >= need
            r = row_requests(&tab[t, 0]) + extra[k]
            cost = (row_pending(&tab[t, 0]) + extra[m + k] + tokens + weight * r) if use_demand else r
            key = fr_load_i64(&tab[t, COL_ORDER_KEY])
            if best < 0:
                better = True
            elif fits != best_fits:
                better = fits
            elif fits:
                better = cost < best_cost or (cost == best_cost and key < best_key)
            else:
                better = free > best_free or (free == best_free and key < best_key)
            if better:
                best, best_fits, best_cost, best_free, best_key = k, fits, cost, free, key
        if best < 0:
            return -1
        picks[s] = cands[best]
        picks[n + s] = plan_level(best_cost, best_fits, best_free)
        extra[best] += 1
        extra[m + best] += tokens
    return plan_place(picks, n, slot, strict)


# ---- thin Python wrappers, for tests and the reference comparison ------------------------------
# The kernels run without bounds checks; these entry points check every index a caller hands in
# (table width, candidate and ring rows, cursor, RNG state) so Python can never make them read
# outside the arrays.  Picker (in _ledger) validates its candidates once, when they are set.

cdef int _check_table(const int64_t[:, ::1] tab) except -1:
    if tab.shape[1] != NCOLS:
        raise ValueError(f"not a target table: {tab.shape[1]} columns, expected {NCOLS}")
    return 0


cdef int _check_rows(const int64_t[:, ::1] tab, const int64_t[::1] rows, str what) except -1:
    cdef Py_ssize_t k
    _check_table(tab)
    for k in range(rows.shape[0]):
        if rows[k] < 0 or rows[k] >= tab.shape[0]:
            raise IndexError(f"{what} {rows[k]} out of the table's range 0..{tab.shape[0] - 1}")
    return 0


cdef uint64_t *_rng_state(state) except NULL:
    if not (isinstance(state, np.ndarray) and state.dtype == np.uint64 and state.shape == (1,)):
        raise TypeError("rng state must be a numpy uint64 array of shape (1,)")
    cdef uint64_t[::1] s = state
    # The caller's array stays alive for the whole call (it is an argument), so the pointer does.
    return &s[0]


def round_robin(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t[::1] cursor):
    _check_rows(tab, cands, "candidate")
    if cursor.shape[0] != 1 or cursor[0] < 0:
        raise ValueError("cursor must be a non-negative int64 array of shape (1,)")
    return pick_round_robin(tab, cands, &cursor[0])


def random_pick(const int64_t[:, ::1] tab, const int64_t[::1] cands, state):
    _check_rows(tab, cands, "candidate")
    return pick_random(tab, cands, _rng_state(state))


def power_of_two(const int64_t[:, ::1] tab, const int64_t[::1] cands, int metric, state):
    _check_rows(tab, cands, "candidate")
    if metric not in (METRIC_TOKENS, METRIC_REQUESTS, METRIC_LEAST_REQUESTS):
        raise ValueError(f"unknown load metric code {metric}")
    return pick_p2c(tab, cands, metric, _rng_state(state))


def demand(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens, int64_t weight, state):
    _check_rows(tab, cands, "candidate")
    return pick_demand(tab, cands, tokens, weight, _rng_state(state))


def kv_fit(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens, int64_t need,
           bint use_demand, int64_t weight, state):
    _check_rows(tab, cands, "candidate")
    return pick_kv_fit(tab, cands, tokens, need, use_demand, weight, _rng_state(state))


def coordinated(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens, int64_t need,
                bint use_demand, int64_t weight, bint kv, int64_t n, int64_t slot,
                bint strict=False):
    """``pick_coordinated`` from Python: (this replica's target, the whole placement sequence)."""
    _check_rows(tab, cands, "candidate")
    if n < 1 or not 0 <= slot < n:
        raise ValueError("need n >= 1 and 0 <= slot < n")
    scratch = np.zeros(2 * cands.shape[0] + 2 * n + 1, dtype=np.int64)
    cdef int64_t[::1] sc = scratch
    cdef int64_t mine = pick_coordinated(tab, cands, tokens, need, use_demand, weight, kv, n, slot,
                                         strict, &sc[0], &sc[2 * cands.shape[0]])
    if mine < 0:
        return -1, []
    return mine, [int(x) for x in scratch[2 * cands.shape[0]:2 * cands.shape[0] + n]]


def narrow(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens, int64_t need,
           int kv_mode, int demand_mode, int64_t weight):
    """cache_aware's candidate filter, KV fit then decode input demand, in one call.

    Returns ``(choose, fits, ties, no_capacity)``: the candidates the prefix tree chooses among
    (None: all of ``cands``), the KV-fit set (None when KV fit is off or no candidate's capacity
    is known, which ``no_capacity`` tells), and the demand ties (None when demand is off).
    Modes are fastroute.names.MODE_CODE (0 off, 1 shadow, 2 on).

    KV fit: the eligible candidates where ``need`` tokens fit in estimated free KV (``kv_free``),
    or, when none fits, those with the most free KV; on, they replace the candidates. Demand: the
    eligible candidates of least demand cost (``pick_demand``'s cost) among those; on, the tree
    chooses among them. Shadow modes compute the set and leave the candidates as they are."""
    _check_rows(tab, cands, "candidate")
    cdef list fits = None, roomiest = [], ties = None
    cdef object choose = None
    cdef bint no_capacity = False
    cdef int64_t t, free, room_free = 0
    cdef Py_ssize_t k
    if kv_mode != 0:
        fits = []
        for k in range(cands.shape[0]):
            t = cands[k]
            free = eligible_free(tab, t)
            if free == INT64_MIN:
                continue
            if not roomiest or free > room_free:
                roomiest = [t]
                room_free = free
            elif free == room_free:
                roomiest.append(t)
            if free >= need:
                fits.append(t)
        if not roomiest:
            no_capacity = True
            fits = None
        elif not fits:
            fits = roomiest
        if kv_mode == 2 and fits is not None:
            choose = fits
    if demand_mode != 0:
        ties = _demand_ties(tab, cands if choose is None else np.asarray(choose, dtype=np.int64), tokens, weight)
        if demand_mode == 2:
            choose = ties
    return choose, fits, ties, no_capacity


cdef list _demand_ties(const int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens, int64_t weight):
    """Every eligible candidate of minimal demand cost, in candidate order."""
    cdef list ties = []
    cdef int64_t t, cost, best = 0
    cdef Py_ssize_t k
    for k in range(cands.shape[0]):
        t = cands[k]
        if not row_eligible(&tab[t, 0]):
            continue
        cost = demand_cost(&tab[t, 0], tokens, weight)
        if not ties or cost < best:
            ties = [t]
            best = cost
        elif cost == best:
            ties.append(t)
    return ties


def free_kv(const int64_t[:, ::1] tab, int64_t t):
    """Estimated free KV tokens of target t, or None when its capacity is unknown."""
    _check_table(tab)
    if t < 0 or t >= tab.shape[0]:
        raise IndexError(f"target {t} out of the table's range")
    cdef int64_t f = kv_free(tab, t)
    return None if f == INT64_MIN else f


def ring_lookup(const int64_t[:, ::1] tab, const uint64_t[::1] ring_hash,
                const int64_t[::1] ring_target, uint64_t key):
    if ring_hash.shape[0] != ring_target.shape[0]:
        raise ValueError("ring hashes and targets differ in length")
    _check_rows(tab, ring_target, "ring target")
    return pick_ring(tab, ring_hash, ring_target, key)


def hash64(const unsigned char[::1] data):
    """64-bit hash of a byte string (ring positions and routing keys)."""
    if data.shape[0] == 0:
        return hash_bytes(NULL, 0)
    return hash_bytes(&data[0], data.shape[0])


def layout():
    """Every constant of _layout.pxd and _policy.pxd as compiled, so tests can check that
    table.py and fastroute.names mirror them (tests/unit/test_table.py)."""
    return dict(
        COL_IN_FLIGHT=COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS=COL_IN_FLIGHT_TOKENS,
        COL_POLLED_RUNNING=COL_POLLED_RUNNING, COL_POLLED_WAITING=COL_POLLED_WAITING,
        COL_POLLED_TOKENS=COL_POLLED_TOKENS, COL_POLLED_AT=COL_POLLED_AT, COL_HEALTHY=COL_HEALTHY,
        COL_PICKS=COL_PICKS, COL_CIRCUIT=COL_CIRCUIT, COL_POLLED_MAX_TOKENS=COL_POLLED_MAX_TOKENS,
        COL_ALLOCATED=COL_ALLOCATED, COL_TOKENS_AT_POLL=COL_TOKENS_AT_POLL,
        COL_CB_FAILS=COL_CB_FAILS, COL_CB_OKS=COL_CB_OKS, COL_CB_OPENED_AT=COL_CB_OPENED_AT,
        COL_OTHERS_OPEN=COL_OTHERS_OPEN, COL_OTHERS_IN_FLIGHT=COL_OTHERS_IN_FLIGHT,
        COL_OTHERS_TOKENS=COL_OTHERS_TOKENS, COL_OTHERS_EST=COL_OTHERS_EST,
        COL_OTHERS_EST_TOKENS=COL_OTHERS_EST_TOKENS, COL_ORDER_KEY=COL_ORDER_KEY,
        COL_POLLED_UNCACHED=COL_POLLED_UNCACHED, COL_POLLED_KV_QUEUE=COL_POLLED_KV_QUEUE,
        COL_POLLED_MAX_RUNNING=COL_POLLED_MAX_RUNNING, NCOLS=NCOLS,
        HDR_MAGIC=HDR_MAGIC, HDR_CAPACITY=HDR_CAPACITY, HDR_UNDERFLOWS=HDR_UNDERFLOWS,
        HDR_GENERATION=HDR_GENERATION, HDR_REPLICAS=HDR_REPLICAS,
        HDR_REPLICA_SLOT=HDR_REPLICA_SLOT, HDR_SYNC_TICKS=HDR_SYNC_TICKS, NHDR=NHDR,
        HDR_FEED_ON=HDR_FEED_ON, HDR_FEED_AT=HDR_FEED_AT, HDR_FEED=HDR_FEED,
        HDR_FEED_SLOTS=HDR_FEED_SLOTS, HDR_FEED_ROW_BITS=HDR_FEED_ROW_BITS,
        CIRCUIT_CLOSED=CIRCUIT_CLOSED, CIRCUIT_OPEN=CIRCUIT_OPEN,
        CIRCUIT_HALF_OPEN=CIRCUIT_HALF_OPEN,
        METRIC_TOKENS=METRIC_TOKENS, METRIC_REQUESTS=METRIC_REQUESTS,
        METRIC_LEAST_REQUESTS=METRIC_LEAST_REQUESTS,
        MODE_OFF=MODE_OFF, MODE_SHADOW=MODE_SHADOW, MODE_ON=MODE_ON,
    )
