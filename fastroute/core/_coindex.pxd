# The coordinated index of a Picker (issue #52): synced replicas' plan (_policy.pick_coordinated)
# from a tournament tree over the candidates, so that the n placements of a pick cost
# n x log2(candidates) instead of n scans, and the idle test (nothing in flight or estimated on
# any candidate) reads one cell instead of scanning.
#
# A leaf holds what the scan compares of its row: a class (C_FIT: eligible and, under KV fit,
# of known capacity; C_ANY: eligible, capacity unknown; C_NONE: not eligible), the cost
# (requests across replicas, or pending tokens + weight x requests under demand), the shared
# order key, the estimated free KV (INT64_MIN where unknown or KV fit is off) and whether
# anything is in flight or estimated there (COL_IN_FLIGHT, COL_OTHERS_IN_FLIGHT, COL_OTHERS_EST).
# A node keeps the leaf of the least (class, cost, order key, candidate position) below it (the
# position makes the minimum unique, as the scan's first-in-order on a full tie), the leaf of
# the most free KV (ties: the smaller order key, then position) and how many leaves below are
# busy.  The keys live in the leaves; a node holds leaf numbers only.
#
# A plan takes the least leaf (KV fit with a known capacity anywhere: the least leaf where the
# need fits, else the roomiest), then charges it in place (cost + 1, or + tokens + weight; free
# KV - tokens) and walks up, n times.  A plan that is booked keeps its charges: the booking
# writes each charged row (this replica's lease, the others' estimates) and posts it, and the
# next drain finds the leaf already equal to its row (no walk) unless the row moved otherwise;
# a plan that is not booked reads every leaf it charged again from its row.  The first time a
# plan reaches a leaf, the leaf is checked against its row (a writer between its write and its
# feed notice): a leaf that differs is corrected and the plan starts over (a few times, then
# the caller scans).  The roomiest leaf of a node is kept under KV fit only.
#
# The tree is fed as the load index is (_index.pxd): by the table header's feed, drained before
# each use, rebuilt when it fell behind.  A separate structure from _index.Index so the two
# evolve apart; only the feed (its cells, and how a reader walks them) is shared (_layout.pxd).
from libc.stdint cimport int64_t, INT64_MIN
from fastroute.core._atomic cimport fr_load_i64
from fastroute.core._layout cimport (
    COL_IN_FLIGHT, COL_OTHERS_IN_FLIGHT, COL_OTHERS_EST, COL_ORDER_KEY, NCOLS, row_eligible,
    row_requests, row_pending, row_kv_free, HDR_FEED_AT, HDR_FEED_SLOTS, feed_row, feed_next, plan_level,
    plan_place,
)

cdef enum:
    C_FIT = 0                    # eligible (KV fit: and its capacity is known)
    C_ANY = 1                    # eligible, capacity unknown (KV fit only)
    C_NONE = 2                   # not eligible
    LEAF = 6                     # cells per leaf: class, cost, order key, free KV, busy, unused
    CN = 3                       # cells per node: least leaf, roomiest leaf, busy leaves below
    CSTACK = 64                  # the fit search's stack (two per level at most)
    COORD_SCAN = -3              # coord_plan: leaves kept disagreeing with rows: scan instead
    COORD_RETRIES = 3


ctypedef struct Coord:
    bint on                      # built (the Picker holds a feed use for it)
    bint demand                  # cost by demand (pending tokens + weight x requests)
    bint kv                      # KV fit: fit first, else the most free KV
    int64_t weight
    int64_t size                 # leaves: a power of two >= n
    int64_t n                    # candidates
    int64_t pos                  # the next feed position to read
    int64_t rebuilds
    int64_t mapped               # rows leaf_of covers
    int64_t *leaves              # LEAF cells per leaf
    int64_t *nodes               # CN cells per node 1 .. 2 x size - 1 (node size + i: leaf i)
    int64_t *extra               # per leaf: placements of the plan under way (0 between plans)
    const int64_t *leaf_of       # table row -> leaf, -1: not a candidate
    const int64_t *tab
    const int64_t *cands         # leaf -> table row
    const int64_t *header


cdef inline void coord_read(const Coord *c, int64_t t, int64_t *k) noexcept nogil:
    # Row t as a leaf (k: LEAF cells).
    cdef const int64_t *row = c.tab + t * NCOLS
    cdef int64_t free, r
    k[2] = fr_load_i64(&row[COL_ORDER_KEY])
    k[3] = INT64_MIN
    k[4] = 1 if (fr_load_i64(&row[COL_IN_FLIGHT]) != 0 or fr_load_i64(&row[COL_OTHERS_IN_FLIGHT]) != 0
                 or fr_load_i64(&row[COL_OTHERS_EST]) != 0) else 0
    k[5] = 0
    if not row_eligible(row):
        k[0] = C_NONE
        k[1] = 0
        return
    k[0] = C_FIT
    if c.kv:
        free = row_kv_free(row)
        if free == INT64_MIN:
            k[0] = C_ANY
        else:
            k[3] = free
    r = row_requests(row)
    k[1] = row_pending(row) + c.weight * r if c.demand else r


cdef inline bint coord_less(const int64_t *lv, int64_t a, int64_t b) noexcept nogil:
    # Leaf a's key before leaf b's: (class, cost, order key, position).
    cdef const int64_t *x = lv + LEAF * a
    cdef const int64_t *y = lv + LEAF * b
    if x[0] != y[0]:
        return x[0] < y[0]
    if x[1] != y[1]:
        return x[1] < y[1]
    if x[2] != y[2]:
        return x[2] < y[2]
    return a < b


cdef inline bint coord_roomier(const int64_t *lv, int64_t a, int64_t b) noexcept nogil:
    # Leaf a before leaf b by free KV: more free, then the smaller order key, then position.
    cdef const int64_t *x = lv + LEAF * a
    cdef const int64_t *y = lv + LEAF * b
    if x[3] != y[3]:
        return x[3] > y[3]
    if x[2] != y[2]:
        return x[2] < y[2]
    return a < b


cdef inline void coord_up(Coord *c, int64_t leaf) noexcept nogil:
    # Leaf ``leaf``'s cells changed: recompute its ancestors, up while one still changes or
    # still names this leaf (its key moved: every node naming it compares again).
    cdef int64_t j = (c.size + leaf) >> 1, w, m, b, l, r
    cdef int64_t *nd
    cdef const int64_t *lc
    cdef const int64_t *rc
    c.nodes[CN * (c.size + leaf) + 2] = c.leaves[LEAF * leaf + 4]
    while j >= 1:
        nd = c.nodes + CN * j
        lc = c.nodes + CN * 2 * j
        rc = lc + CN
        l = lc[0]
        r = rc[0]
        w = l if coord_less(c.leaves, l, r) else r
        m = -1
        if c.kv:
            l = lc[1]
            r = rc[1]
            m = l if coord_roomier(c.leaves, l, r) else r
        b = lc[2] + rc[2]
        if w == nd[0] and m == nd[1] and b == nd[2] and w != leaf and m != leaf:
            return
        nd[0] = w
        nd[1] = m
        nd[2] = b
        j >>= 1


cdef inline void coord_set(Coord *c, int64_t leaf, const int64_t *k) noexcept nogil:
    cdef int64_t *x = c.leaves + LEAF * leaf
    cdef int i
    if x[0] == k[0] and x[1] == k[1] and x[2] == k[2] and x[3] == k[3] and x[4] == k[4]:
        return
    for i in range(LEAF):
        x[i] = k[i]
    coord_up(c, leaf)


cdef inline void coord_rebuild(Coord *c) noexcept nogil:
    # The feed position first, then the rows: a write after the rows were read is in the feed.
    cdef int64_t leaf, j, l, r
    cdef int64_t *x
    cdef int64_t *nd
    c.pos = fr_load_i64(&c.header[HDR_FEED_AT])
    for leaf in range(c.size):
        x = c.leaves + LEAF * leaf
        if leaf < c.n:
            coord_read(c, c.cands[leaf], x)
        else:
            x[0] = C_NONE
            x[1] = 0
            x[2] = 0
            x[3] = INT64_MIN
            x[4] = 0
            x[5] = 0
        nd = c.nodes + CN * (c.size + leaf)
        nd[0] = leaf
        nd[1] = leaf
        nd[2] = x[4]
    j = c.size - 1
    while j >= 1:
        nd = c.nodes + CN * j
        l = nd[CN * j]                   # node 2j's cells start CN x j cells after node j's
        r = nd[CN * j + CN]
        nd[0] = l if coord_less(c.leaves, l, r) else r
        nd[1] = -1
        if c.kv:
            l = nd[CN * j + 1]
            r = nd[CN * j + CN + 1]
            nd[1] = l if coord_roomier(c.leaves, l, r) else r
        nd[2] = nd[CN * j + 2] + nd[CN * j + CN + 2]
        j -= 1
    c.rebuilds += 1


cdef inline void coord_drain(Coord *c) noexcept nogil:
    # Re-read the rows published since c.pos (the rules of _index.index_drain).
    cdef int64_t end = fr_load_i64(&c.header[HDR_FEED_AT])
    cdef int64_t i, row, leaf, hole = -1
    cdef int64_t k[LEAF]
    if end - c.pos > HDR_FEED_SLOTS:
        coord_rebuild(c)
        return
    for i in range(c.pos, end):
        row = feed_row(c.header, i, &hole)
        if 0 <= row < c.mapped:
            leaf = c.leaf_of[row]
            if leaf >= 0:
                coord_read(c, row, k)
                coord_set(c, leaf, k)
    if feed_next(end, hole, &c.pos):
        coord_rebuild(c)


cdef inline bint coord_idle(const Coord *c) noexcept nogil:
    # Nothing in flight or estimated on any candidate (after a drain).
    return c.nodes[CN + 2] == 0


cdef inline int64_t coord_fit(const Coord *c, int64_t need) noexcept nogil:
    # The least C_FIT leaf whose free KV holds ``need``, or -1.  A node whose least leaf fits
    # answers for its subtree; one whose roomiest leaf does not fit, or whose least leaf is not
    # before the best found, is skipped.
    cdef int64_t stack[CSTACK]
    cdef int64_t sp = 1, j, w, a, b, best = -1
    cdef const int64_t *lv = c.leaves
    stack[0] = 1
    while sp > 0:
        sp -= 1
        j = stack[sp]
        w = c.nodes[CN * j]
        if lv[LEAF * w] != C_FIT or lv[LEAF * c.nodes[CN * j + 1] + 3] < need:
            continue
        if best >= 0 and not coord_less(lv, w, best):
            continue
        if lv[LEAF * w + 3] >= need:
            best = w
            continue
        if j >= c.size:
            continue
        a = 2 * j
        b = a + 1
        if coord_less(lv, c.nodes[CN * b], c.nodes[CN * a]):
            a, b = b, a
        stack[sp] = b                    # the child of the lesser least leaf is read first
        stack[sp + 1] = a
        sp += 2
    return best


cdef inline void coord_restore(Coord *c, const int64_t *picks, int64_t s) noexcept nogil:
    # Undo the charges of placements 0 .. s-1: their leaves read again from their rows.
    cdef int64_t i, leaf
    cdef int64_t k[LEAF]
    for i in range(s):
        leaf = c.leaf_of[picks[i]]
        if c.extra[leaf] != 0:
            c.extra[leaf] = 0
            coord_read(c, picks[i], k)
            coord_set(c, leaf, k)


cdef inline int64_t coord_plan(Coord *c, int64_t tokens, int64_t need, int64_t n, int64_t slot,
                               bint strict, int64_t *picks, bint keep) noexcept nogil:
    # pick_coordinated from the tree (after a drain): picks[0..n) the placements' rows,
    # picks[n..2n) their cost levels, picks[2n] this replica's place; returns its row, -1 when
    # nothing is eligible, COORD_SCAN when leaves kept disagreeing with their rows.  keep: the
    # caller books every placement (each charged row is then written and posted), so the
    # charges stay in the tree.
    cdef int64_t s, leaf, step = tokens + c.weight if c.demand else 1
    cdef int64_t k[LEAF]
    cdef int64_t *x
    cdef bint known, fits
    cdef int attempt
    for attempt in range(COORD_RETRIES):
        leaf = c.nodes[CN]
        if c.leaves[LEAF * leaf] == C_NONE:
            return -1
        known = c.kv and c.leaves[LEAF * leaf] == C_FIT
        s = 0
        while s < n:
            fits = True
            if known:
                leaf = coord_fit(c, need)
                if leaf < 0:
                    leaf = c.nodes[CN + 1]
                    fits = False
            else:
                leaf = c.nodes[CN]
            x = c.leaves + LEAF * leaf
            if c.extra[leaf] == 0:
                coord_read(c, c.cands[leaf], k)
                if not (x[0] == k[0] and x[1] == k[1] and x[2] == k[2] and x[3] == k[3]):
                    coord_restore(c, picks, s)
                    coord_set(c, leaf, k)
                    break
            picks[s] = c.cands[leaf]
            picks[n + s] = plan_level(x[1] + tokens if c.demand else x[1], fits, x[3])
            c.extra[leaf] += 1
            x[1] += step
            if known:
                x[3] -= tokens
            coord_up(c, leaf)
            s += 1
        if s < n:
            continue
        if keep:
            for s in range(n):
                c.extra[c.leaf_of[picks[s]]] = 0
        else:
            coord_restore(c, picks, n)
        return plan_place(picks, n, slot, strict)
    return COORD_SCAN
