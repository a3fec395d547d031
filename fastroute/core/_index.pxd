# The load index of a Picker (issue #52): a tournament tree over its candidates, so that a
# least_requests or demand pick costs a descent of log2(candidates) levels instead of a scan.
#
# Each node is 4 int64 cells: the key (class, a, b) of the least leaf below it, compared in that
# order, and how many leaves below it hold exactly that key.  A leaf's key is what the scan in
# _policy.pyx compares: least_requests (class 0 polled: requests across replicas, polled tokens;
# class 1 never polled: requests, 0), so an eligible polled leaf always beats an unpolled one,
# which is the scan's "only polled rows when any is"; demand (class 0: pending tokens + weight x
# requests).  Class 2 is a leaf that is not eligible, with a count of 0.  A pick draws one number
# below the root's count and descends to that tied leaf in candidate order: uniform over the
# exact minimum, as the scan's reservoir is.
#
# The tree is the picker's own (process-local memory: no lock).  What keeps it true is the
# table header's feed (_layout.feed_publish): every writer of a cell a key reads publishes the
# row after its write, in whatever process; a pick first re-reads the rows published since its
# last one.  A feed it fell behind on by more than the ring holds is replaced by a rebuild.
from libc.stdint cimport int64_t, uint64_t
from fastroute.core._atomic cimport fr_load_i64
from fastroute.core._layout cimport (
    COL_POLLED_AT, COL_POLLED_TOKENS, NCOLS, row_eligible, row_requests, row_pending,
    HDR_FEED_AT, HDR_FEED, HDR_FEED_SLOTS, HDR_FEED_ROW_BITS,
)
from fastroute.core._random cimport rng_below

cdef enum:
    INDEX_NONE = 0
    INDEX_LEAST_REQUESTS = 1
    INDEX_DEMAND = 2
    INDEX_MIN_CANDS = 64         # fewer candidates are scanned (the scan is as cheap)
    CLS_POLLED = 0
    CLS_UNPOLLED = 1
    CLS_NONE = 2                 # not eligible


cdef inline void leaf_key(const int64_t *row, int kind, int64_t weight, int64_t *k) noexcept nogil:
    if not row_eligible(row):
        k[0] = CLS_NONE
        k[1] = 0
        k[2] = 0
        k[3] = 0
        return
    k[3] = 1
    if kind == INDEX_DEMAND:
        k[0] = CLS_POLLED
        k[1] = row_pending(row) + weight * row_requests(row)
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


cdef inline bint node_pull(int64_t *nodes, int64_t j) noexcept nogil:
    # Node j from its two children; False when it did not change (nor will its ancestors).
    cdef int64_t *n = nodes + 4 * j
    cdef int64_t *l = nodes + 8 * j
    cdef int64_t *r = l + 4
    cdef int c = key_cmp(l, r)
    cdef int64_t *src = l if c <= 0 else r
    cdef int64_t cnt = l[3] + r[3] if c == 0 else src[3]
    if n[0] == src[0] and n[1] == src[1] and n[2] == src[2] and n[3] == cnt:
        return False
    n[0] = src[0]
    n[1] = src[1]
    n[2] = src[2]
    n[3] = cnt
    return True


cdef inline void set_leaf(int64_t *nodes, int64_t size, int64_t leaf, const int64_t *k) noexcept nogil:
    cdef int64_t j = size + leaf
    cdef int64_t *n = nodes + 4 * j
    if n[0] == k[0] and n[1] == k[1] and n[2] == k[2] and n[3] == k[3]:
        return
    n[0] = k[0]
    n[1] = k[1]
    n[2] = k[2]
    n[3] = k[3]
    j >>= 1
    while j >= 1 and node_pull(nodes, j):
        j >>= 1


cdef inline void build(int64_t *nodes, int64_t size, const int64_t *tab, const int64_t *cands,
                       int64_t n, int kind, int64_t weight) noexcept nogil:
    cdef int64_t leaf, j
    for leaf in range(size):
        if leaf < n:
            leaf_key(tab + cands[leaf] * NCOLS, kind, weight, nodes + 4 * (size + leaf))
        else:
            nodes[4 * (size + leaf)] = CLS_NONE
            nodes[4 * (size + leaf) + 1] = 0
            nodes[4 * (size + leaf) + 2] = 0
            nodes[4 * (size + leaf) + 3] = 0
    j = size - 1
    while j >= 1:
        node_pull(nodes, j)
        j -= 1


cdef inline int64_t descend(const int64_t *nodes, int64_t size, uint64_t *rng) noexcept nogil:
    # The leaf of the r-th tied minimum (candidate order), r drawn below the root's count; -1
    # when no leaf is eligible (no draw then).
    cdef const int64_t *n = nodes + 4
    cdef const int64_t *l
    cdef int64_t j = 1
    cdef int64_t r
    if n[0] == CLS_NONE:
        return -1
    r = <int64_t>rng_below(rng, <uint64_t>n[3])
    while j < size:
        l = nodes + 8 * j
        if l[0] == n[0] and l[1] == n[1] and l[2] == n[2]:
            if r < l[3]:
                j = 2 * j
                continue
            r -= l[3]
        j = 2 * j + 1
    return j - size


cdef inline bint leaf_is(const int64_t *nodes, int64_t size, int64_t leaf, const int64_t *k) noexcept nogil:
    cdef const int64_t *n = nodes + 4 * (size + leaf)
    return n[0] == k[0] and n[1] == k[1] and n[2] == k[2] and n[3] == k[3]


cdef inline int64_t drain(int64_t *nodes, int64_t size, const int64_t *tab, const int64_t *leaf_of,
                          int64_t mapped, const int64_t *header, int64_t pos, int kind,
                          int64_t weight) noexcept nogil:
    # Re-read the rows published since ``pos``; returns the position to read from next time, or
    # -1 when the index must be rebuilt (the ring has moved past what it holds).  A cell whose
    # notice is not written yet (a writer between its two steps, or one that died there) is
    # read again next time with everything after it (re-reading a row is harmless), until the
    # ring moves half its length past it.
    cdef int64_t end = fr_load_i64(&header[HDR_FEED_AT])
    cdef int64_t i, v, row, leaf, hole = -1
    cdef int64_t k[4]
    cdef int64_t tag_mask = (<int64_t>1 << (63 - HDR_FEED_ROW_BITS)) - 1
    if end - pos > HDR_FEED_SLOTS:
        return -1
    for i in range(pos, end):
        v = fr_load_i64(&header[HDR_FEED + (i & (HDR_FEED_SLOTS - 1))])
        if (v >> HDR_FEED_ROW_BITS) != (i & tag_mask):
            if hole < 0:
                hole = i
            continue
        row = v & ((<int64_t>1 << HDR_FEED_ROW_BITS) - 1)
        if row < mapped:
            leaf = leaf_of[row]
            if leaf >= 0:
                leaf_key(tab + row * NCOLS, kind, weight, k)
                set_leaf(nodes, size, leaf, k)
    if hole < 0:
        return end
    if end - hole > HDR_FEED_SLOTS // 2:
        return -1
    return hole
