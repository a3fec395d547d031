# The load index of a Picker (issue #52): a tournament tree over its candidates, so that a
# least_requests, demand or KV-fit pick costs a descent of log2(candidates) levels, not a scan.
#
# Each node is NODE int64 cells: the key (class, a, b) of the least leaf below it, compared in
# that order, with how many leaves below it hold exactly that key; then the most free KV of a
# leaf below it, with how many hold that much (KV fit only).  A leaf's key is what the scan in
# _policy.pyx compares: least_requests (class 0 polled: requests across replicas, polled tokens;
# class 1 never polled: requests, 0), so an eligible polled leaf always beats an unpolled one,
# which is the scan's "only polled rows when any is"; demand (class 0: pending tokens + weight x
# requests); KV fit (class 0, a rank of known capacity: requests, -free KV); the prefix tree's
# (class 0: requests, the second aggregate the most requests, for cache_aware's balance rule);
# cache_aware's KV-fit check (class 0: free KV, INT64_MIN when the capacity is unknown, so the
# root holds the least free KV of any eligible rank).  Class 2 is a leaf
# that is not eligible (or, for KV fit, of unknown capacity), with a count of 0.  A pick draws
# one number below the count of the tied minimum and descends to that tie in candidate order:
# uniform over the exact minimum, as the scan's reservoir is.
#
# KV fit wants the least key among the leaves where the request's ``need`` fits.  Leaves of one
# key have one free KV (it is in the key), so where a node's least key fits, so do all its ties:
# the search stops there, and goes down only into nodes whose least key does not fit but whose
# most free KV does.  Its cost is log2(candidates) per leaf that does not fit and has a key below
# the answer; none fits: the most free KV, from the root.
#
# The tree is the picker's own (process-local memory: no lock).  What keeps it true is the
# table header's feed (_layout.feed_publish): every writer of a cell a key reads publishes the
# row after its write, in whatever process; a pick first re-reads the rows published since its
# last one.  A feed it fell behind on by more than the ring holds is replaced by a rebuild.
from libc.stdint cimport int64_t, uint64_t, INT64_MIN
from fastroute.core._atomic cimport fr_load_i64
from fastroute.core._layout cimport (
    COL_POLLED_AT, COL_POLLED_TOKENS, NCOLS, row_eligible, row_requests, row_pending, row_kv_free,
    HDR_FEED_AT, HDR_FEED_SLOTS, feed_row, feed_next,
)
from fastroute.core._random cimport rng_below

cdef enum:
    INDEX_NONE = 0
    INDEX_LEAST_REQUESTS = 1
    INDEX_DEMAND = 2
    INDEX_KV_FIT = 3
    INDEX_TREE = 4               # cache_aware's tree: requests, and the most requests below a node
    INDEX_LEAST_FREE = 5         # cache_aware's KV fit: free KV (INT64_MIN unknown), least at the root
    INDEX_MIN_CANDS = 64         # fewer candidates are scanned (the scan is as cheap)
    CLS_POLLED = 0
    CLS_UNPOLLED = 1
    CLS_NONE = 2                 # not eligible
    NODE = 8                     # cells per node: class, a, b, ties, most free, its ties, 2 unused
    STACK = 64                   # the KV search's stack (a right sibling per level at most)
    PICK_SCAN = -3               # index_pick: the index disagrees with a row: scan instead


ctypedef struct Index:
    int kind
    int64_t size                 # leaves: a power of two >= n
    int64_t n                    # candidates
    int64_t pos                  # the next feed position to read
    int64_t weight               # demand: the request weight
    int64_t rebuilds
    int64_t mapped               # rows leaf_of covers
    int64_t *nodes               # NODE cells per node, nodes 1 .. 2 x size - 1
    const int64_t *leaf_of       # table row -> leaf, -1: not a candidate
    const int64_t *tab           # the table's rows
    const int64_t *cands         # leaf -> table row
    const int64_t *header        # the table's header (the feed)


cdef inline void leaf_key(const Index *x, int64_t t, int64_t *k) noexcept nogil:
    cdef const int64_t *row = x.tab + t * NCOLS
    cdef int64_t free
    k[4] = INT64_MIN
    k[5] = 0
    if not row_eligible(row):
        k[0] = CLS_NONE
        k[1] = 0
        k[2] = 0
        k[3] = 0
        return
    k[3] = 1
    if x.kind == INDEX_KV_FIT:
        free = row_kv_free(row)
        if free == INT64_MIN:
            k[0] = CLS_NONE
            k[1] = 0
            k[2] = 0
            k[3] = 0
            return
        k[0] = CLS_POLLED
        k[1] = row_requests(row)
        k[2] = -free
        k[4] = free
        k[5] = 1
    elif x.kind == INDEX_DEMAND:
        k[0] = CLS_POLLED
        k[1] = row_pending(row) + x.weight * row_requests(row)
        k[2] = 0
    elif x.kind == INDEX_TREE:
        k[0] = CLS_POLLED
        k[1] = row_requests(row)
        k[2] = 0
        k[4] = k[1]
        k[5] = 1
    elif x.kind == INDEX_LEAST_FREE:
        k[0] = CLS_POLLED
        k[1] = row_kv_free(row)
        k[2] = 0
    elif fr_load_i64(&row[COL_POLLED_AT]) >= 0:
        k[0] = CLS_POLLED
        k[1] = row_requests(row)
        k[2] = fr_load_i64(&row[COL_POLLED_TOKENS])
    else:
        k[0] = CLS_UNPOLLED
        k[1] = row_requests(row)
        k[2] = 0


cdef inline int key_cmp(const int64_t *x, const int64_t *y) noexcept nogil:
    if x[0] != y[0]:
        return -1 if x[0] < y[0] else 1
    if x[1] != y[1]:
        return -1 if x[1] < y[1] else 1
    if x[2] != y[2]:
        return -1 if x[2] < y[2] else 1
    return 0


cdef inline bint same(const int64_t *x, const int64_t *y) noexcept nogil:
    return (x[0] == y[0] and x[1] == y[1] and x[2] == y[2] and x[3] == y[3] and x[4] == y[4]
            and x[5] == y[5])


cdef inline void copy_node(int64_t *n, const int64_t *k) noexcept nogil:
    n[0] = k[0]
    n[1] = k[1]
    n[2] = k[2]
    n[3] = k[3]
    n[4] = k[4]
    n[5] = k[5]


cdef inline bint node_pull(int64_t *nodes, int64_t j) noexcept nogil:
    # Node j from its two children; False when it did not change (nor will its ancestors).
    cdef int64_t *n = nodes + NODE * j
    cdef int64_t *l = nodes + 2 * NODE * j
    cdef int64_t *r = l + NODE
    cdef int c = key_cmp(l, r)
    cdef int64_t *src = l if c <= 0 else r
    cdef int64_t *big = l if l[4] >= r[4] else r
    cdef int64_t k[6]
    k[0] = src[0]
    k[1] = src[1]
    k[2] = src[2]
    k[3] = l[3] + r[3] if c == 0 else src[3]
    k[4] = big[4]
    k[5] = l[5] + r[5] if l[4] == r[4] else big[5]
    if same(n, k):
        return False
    copy_node(n, k)
    return True


cdef inline void set_leaf(Index *x, int64_t leaf, const int64_t *k) noexcept nogil:
    cdef int64_t j = x.size + leaf
    cdef int64_t *n = x.nodes + NODE * j
    if same(n, k):
        return
    copy_node(n, k)
    j >>= 1
    while j >= 1 and node_pull(x.nodes, j):
        j >>= 1


cdef inline void index_rebuild(Index *x) noexcept nogil:
    # The feed position first, then the rows: a write after the rows were read is in the feed.
    cdef int64_t leaf, j
    cdef int64_t *n
    x.pos = fr_load_i64(&x.header[HDR_FEED_AT])
    for leaf in range(x.size):
        n = x.nodes + NODE * (x.size + leaf)
        if leaf < x.n:
            leaf_key(x, x.cands[leaf], n)
        else:
            n[0] = CLS_NONE
            n[1] = 0
            n[2] = 0
            n[3] = 0
            n[4] = INT64_MIN
            n[5] = 0
    j = x.size - 1
    while j >= 1:
        node_pull(x.nodes, j)
        j -= 1
    x.rebuilds += 1


cdef inline void index_drain(Index *x) noexcept nogil:
    # Re-read the rows published since x.pos (_layout.feed_row / feed_next); rebuild when the
    # ring has moved past what it holds or half its length past a notice never written.
    index_drain_report(x, NULL)


cdef inline int64_t index_drain_report(Index *x, int64_t *out) noexcept nogil:
    # index_drain, and (``out`` not NULL, room for HDR_FEED_SLOTS: a drain reads each notice
    # once) the leaves whose eligibility (their tie count) it changed.  Returns how many, or -1
    # when it rebuilt the index instead (any leaf may have changed).  For an owner that keeps a
    # second tree over the same leaves keyed by eligibility (the prefix tree's smallest tree).
    cdef int64_t end = fr_load_i64(&x.header[HDR_FEED_AT])
    cdef int64_t i, row, leaf, hole = -1, count = 0
    cdef int64_t k[6]
    if end - x.pos > HDR_FEED_SLOTS:
        index_rebuild(x)
        return -1
    for i in range(x.pos, end):
        row = feed_row(x.header, i, &hole)
        if 0 <= row < x.mapped:
            leaf = x.leaf_of[row]
            if leaf >= 0:
                leaf_key(x, row, k)
                if out != NULL and x.nodes[NODE * (x.size + leaf) + 3] != k[3]:
                    out[count] = leaf
                    count += 1
                set_leaf(x, leaf, k)
    if feed_next(end, hole, &x.pos):
        index_rebuild(x)
        return -1
    return count


cdef inline void nodes_build(int64_t *nodes, int64_t size) noexcept nogil:
    # Every inner node from its children (the leaves written), bottom-up.
    cdef int64_t j = size - 1
    while j >= 1:
        node_pull(nodes, j)
        j -= 1


cdef inline int64_t down_min(const int64_t *nodes, int64_t size, int64_t j, int64_t r) noexcept nogil:
    # From node j, the leaf of the r-th leaf holding j's least key (candidate order).
    cdef const int64_t *n = nodes + NODE * j
    cdef const int64_t *l
    while j < size:
        l = nodes + 2 * NODE * j
        if l[0] == n[0] and l[1] == n[1] and l[2] == n[2]:
            if r < l[3]:
                j = 2 * j
                continue
            r -= l[3]
        j = 2 * j + 1
    return j - size


cdef inline int64_t down_max(const int64_t *nodes, int64_t size, int64_t r) noexcept nogil:
    # From the root, the leaf of the r-th leaf holding the most free KV (candidate order).
    cdef const int64_t *n = nodes + NODE
    cdef const int64_t *l
    cdef int64_t j = 1
    while j < size:
        l = nodes + 2 * NODE * j
        if l[4] == n[4]:
            if r < l[5]:
                j = 2 * j
                continue
            r -= l[5]
        j = 2 * j + 1
    return j - size


cdef inline int64_t fit_search(const Index *x, int64_t need, int64_t *best, int64_t r) noexcept nogil:
    # r < 0: the least key among the leaves where ``need`` fits into best[0..3) and the number
    # of leaves holding it into best[3] (0: none fits); returns -1.  r >= 0 (after a counting
    # search): the leaf of the r-th of those ties in candidate order.
    cdef int64_t stack[STACK]
    cdef int64_t sp = 1, j, c
    cdef const int64_t *n
    if r < 0:
        best[3] = 0
    stack[0] = 1
    while sp > 0:
        sp -= 1
        j = stack[sp]
        n = x.nodes + NODE * j
        if n[3] == 0 or n[4] < need:
            continue                      # nothing eligible below, or nothing below fits
        c = key_cmp(n, best) if best[3] > 0 else -1
        if c > 0:
            continue                      # nothing below beats or ties the best
        if -n[2] >= need:                 # the least key below fits: so do all its ties
            if r >= 0:
                if c == 0:
                    if r < n[3]:
                        return down_min(x.nodes, x.size, j, r)
                    r -= n[3]
            elif c < 0:
                best[0] = n[0]
                best[1] = n[1]
                best[2] = n[2]
                best[3] = n[3]
            else:
                best[3] += n[3]
            continue
        if j >= x.size:
            continue                      # a leaf that does not fit
        stack[sp] = 2 * j + 1             # right pushed first: the left is read first
        stack[sp + 1] = 2 * j
        sp += 2
    return -1


cdef inline int64_t index_pick(Index *x, uint64_t *rng, int64_t need) noexcept nogil:
    # The indexed pick (after draining the feed): a target row; -1 none eligible; for KV fit -2
    # when no eligible rank has a known capacity; PICK_SCAN when the leaf reached disagrees
    # with its row a few times running (the caller scans).  A disagreeing leaf is corrected.
    cdef int64_t leaf, t, attempt
    cdef int64_t best[4]
    cdef int64_t k[6]
    cdef const int64_t *root = x.nodes + NODE
    best[0] = best[1] = best[2] = best[3] = 0
    index_drain(x)
    for attempt in range(3):
        if x.kind == INDEX_KV_FIT:
            if root[5] == 0:
                return -2
            fit_search(x, need, best, -1)
            if best[3] > 0:
                leaf = fit_search(x, need, best, <int64_t>rng_below(rng, <uint64_t>best[3]))
            else:
                leaf = down_max(x.nodes, x.size, <int64_t>rng_below(rng, <uint64_t>root[5]))
        else:
            if root[0] == CLS_NONE:
                return -1
            leaf = down_min(x.nodes, x.size, 1, <int64_t>rng_below(rng, <uint64_t>root[3]))
        t = x.cands[leaf]
        leaf_key(x, t, k)
        if same(x.nodes + NODE * (x.size + leaf), k):
            return t
        set_leaf(x, leaf, k)
    return PICK_SCAN


cdef inline bint index_is_tie(Index *x, int64_t leaf, int64_t need, const int64_t *best) noexcept nogil:
    # Whether ``leaf`` is among what index_pick draws from (best: fit_search's, KV fit only).
    cdef const int64_t *n = x.nodes + NODE * (x.size + leaf)
    cdef const int64_t *root = x.nodes + NODE
    if n[3] == 0:
        return False
    if x.kind != INDEX_KV_FIT:
        return key_cmp(n, root) == 0
    if best[3] > 0:
        return key_cmp(n, best) == 0 and n[4] >= need
    return n[4] == root[4]
