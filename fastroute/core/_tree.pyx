"""The cache_aware policy's compiled core: one approximate radix tree of request text shared by
the targets of a group, and the pick over it.

Text is matched as UTF-8 bytes, one edge label per node, children found by their first byte with
``memchr`` and labels compared eight bytes at a time.  Bytes rather than characters or fixed
chunks: a ``str`` whose text is ASCII hands over its UTF-8 form without a copy
(``PyUnicode_AsUTF8AndSize``), a byte tree needs no tokenizer, and a prefix match on bytes is exact
to the byte, where chunking would lose up to a chunk per request and still compare every byte.
Sizes (``--max-tree-size``) and match rates are therefore counted in bytes; for ASCII prompts that
is the same as SGLang's characters.

Ownership.  A node is *held* by a target when some text inserted for that target runs through the
whole node.  Holding is prefix-closed: whoever holds a node holds its parent.  Per (node, target)
there is one ``Entry``, linked twice: into the node's list of holders and into the target's LRU
list.  An insert touches its path bottom-up, so within a target's LRU list every node is older
than all of its ancestors; the oldest entry of a target is therefore always a leaf *for that
target*, and eviction is "pop the oldest entry" -- O(1) per evicted node with no scan and no heap.
That is why eviction runs inline, on the insert that pushed a target over ``max_tree_size``:
the bound holds after every pick, the work is proportional to what was inserted (each byte is
evicted at most once), and no sweep over the whole tree ever stalls the event loop.  A node whose
last holder goes is childless (prefix-closure) and is freed at once.

Cost per pick.  Under 64 candidates a pick scans them (eligibility stamped per slot for the walk,
min and max in-flight requests, the least-loaded and smallest-tree choices).  A list of 64 or
more distinct rows, used twice running (the Group's own list; KV-fit narrowing hands over a new
list per pick and keeps the scan), is indexed instead: a tournament tree over the candidates
keyed by in-flight requests (``_index.pxd`` INDEX_TREE: its root holds the least load, how many
hold it and the most), fed by the table header's feed as the Picker's is, and a second tree over
the same leaves keyed by bytes held among the eligible.  A holder's eligibility at the walk is
its leaf's; a least-loaded or smallest-tree choice is a descent to a drawn tie.  So a pick costs
the feed notices since the last one times log2(candidates), plus the walk; the chosen row is
checked against its leaf and a disagreement (a lost notice) is corrected and scanned.

Every allocation goes through ``PyMem_*`` so ``tracemalloc`` sees the tree.  The object is not
thread-safe; it is used with the GIL held, from one event loop.
"""
cimport cython
from libc.stdint cimport int32_t, int64_t, uint64_t, uint8_t, INT64_MAX, INT64_MIN
from libc.string cimport memchr, memcpy
from cpython.mem cimport PyMem_Malloc, PyMem_Realloc, PyMem_Free
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from fastroute.core._atomic cimport fr_add_i64
from fastroute.core._layout cimport (
    NCOLS, NHDR, HDR_FEED_ON, HDR_FEED_SLOTS, row_eligible, row_requests, row_kv_free,
)
from fastroute.core._random cimport reservoir_step, rng_below
cimport fastroute.core._index as ix

import numpy as np

from fastroute.core._ledger import mapped as _mapped

cdef extern from "Python.h":
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size) except NULL

# Why the last pick chose its target.
cdef enum:
    R_NONE = 0          # no pick yet / no eligible target
    R_NO_TEXT = 1       # no text: least in-flight
    R_BALANCE = 2       # loads imbalanced: least in-flight
    R_HIT = 3           # prefix match above cache_threshold: a holder of the longest match
    R_SMALLEST = 4      # below the threshold: the smallest tree
    R_LEAST = 5         # below the threshold with a rank slack: the least in-flight

REASON_NONE, REASON_NO_TEXT, REASON_BALANCE, REASON_HIT, REASON_SMALLEST, REASON_LEAST = (
    R_NONE, R_NO_TEXT, R_BALANCE, R_HIT, R_SMALLEST, R_LEAST)


cdef struct Node:
    unsigned char *label    # edge label: a view into base (a split moves it forward, no copy)
    unsigned char *base     # owned buffer; NULL for the root
    int64_t len             # label length in bytes; -1 marks a free pool slot
    int32_t *kids           # one allocation: cap child ids, then cap first-byte keys
    int32_t parent          # parent node id; next free node while on the free list
    int32_t holders         # first Entry of this node's holders, -1 none
    int32_t nkids
    int32_t cap


cdef struct Entry:
    int32_t node
    int32_t slot
    int32_t prev            # older entry of the same slot (-1: this is the slot's LRU head)
    int32_t next            # newer entry of the same slot; next free entry on the free list
    int32_t nnext           # next holder of the same node


cdef inline uint8_t *_keys(Node *x) noexcept nogil:
    return <uint8_t *>(x.kids + x.cap)


cdef inline int64_t _common(const unsigned char *a, const unsigned char *b, int64_t lim) noexcept nogil:
    # Eight bytes per compare; the mismatching word is finished byte by byte (endian-free).
    cdef int64_t i = 0
    cdef uint64_t x, y
    while i + 8 <= lim:
        memcpy(&x, a + i, 8)
        memcpy(&y, b + i, 8)
        if x != y:
            break
        i += 8
    while i < lim and a[i] == b[i]:
        i += 1
    return i


class TreeCorrupt(RuntimeError):
    """``PrefixTree.check`` found a broken structural invariant (a bug in this module)."""


cdef inline int _require(bint ok, str what) except -1:
    # check() raises explicitly: an ``assert`` would check nothing under ``python -O``.
    if not ok:
        raise TreeCorrupt(what)
    return 0


@cython.no_gc_clear  # __dealloc__ gives back the tree's feed uses through its header
cdef class PrefixTree:
    """Radix tree + cache_aware pick over one shared target table (see the module docstring)."""

    cdef object _array               # keeps the shared mapping alive while we hold its pointer
    cdef const int64_t[:, ::1] _tab  # read only: eligibility and in-flight counts
    cdef const int64_t *_rows
    cdef int64_t _nrows

    cdef Node *nodes
    cdef int32_t nnodes_cap, nnodes_used, free_node, live_nodes
    cdef Entry *ents
    cdef int32_t nents_cap, nents_used, free_ent, live_ents

    # per slot (a slot is a target known to this tree)
    cdef int32_t *slot_head          # oldest entry
    cdef int32_t *slot_tail          # newest entry
    cdef int64_t *slot_size          # bytes held
    cdef int64_t *slot_target        # table row; -1 for a free slot
    cdef uint64_t *slot_stamp        # == self.stamp while eligible in the current pick
    cdef int32_t nslots, slots_cap, free_slot
    cdef int32_t *slot_of            # table row -> slot, -1 unknown

    # candidates of the current pick, cached by the identity of the caller's list
    cdef object _cand_obj
    cdef int64_t *cand
    cdef int32_t *cand_slot
    cdef int64_t *cand_load
    cdef uint8_t *cand_ok
    cdef Py_ssize_t ncand, cand_cap

    # walk results
    cdef int32_t *path
    cdef Py_ssize_t plen, path_cap
    cdef int32_t w_node, w_split, w_best
    cdef int64_t w_pos, w_split_m, w_best_len

    # The load index (_index.pxd, kind INDEX_TREE) over a candidate list used twice running, of
    # INDEX_MIN_CANDS or more distinct rows, when the table's header was given: min and max
    # in-flight requests at its root, the least-loaded draw by descent, a holder's eligibility
    # read from its leaf at the walk.  sx: a second tree over the same leaves keyed (eligible,
    # bytes held), for the smallest tree.  With no index the pick scans (_prepare_scan).
    cdef int64_t[::1] _hdr           # the table's header, or an empty view (no index)
    cdef ix.Index lx
    cdef ix.Index sx
    cdef object _lx_keep             # the arrays lx and sx point into
    cdef int64_t *_changed           # index_drain_report's leaves (HDR_FEED_SLOTS)
    cdef bint _lx_tried              # this candidate list was looked at for an index
    cdef bint w_index                # the current pick reads eligibility and loads from lx
    cdef readonly int64_t index_fallbacks   # picks the index disagreed with a row on
    # KV fit (policies.PrefixTree): the group's rows keyed by free KV (INDEX_LEAST_FREE), so
    # that "every eligible rank fits" -- the filter keeps every candidate -- needs no scan.
    cdef ix.Index kx
    cdef bint _lx_use, _kx_use       # this tree's uses of the header's feed (one per index kept)
    cdef object _kx_obj              # the list it indexes (identity, as the candidates)
    cdef object _kx_keep

    cdef uint64_t stamp
    cdef uint64_t rng
    cdef int64_t min_load, max_load
    cdef public double cache_threshold
    cdef public int64_t balance_abs_threshold
    cdef public double balance_rel_threshold
    cdef public int64_t max_tree_size
    # -1: off. N >= 0: only candidates holding at most min + N in-flight requests may be picked
    # (a hit goes to the least-loaded holder of the match, a miss to the least-loaded target).
    cdef public int64_t rank_slack
    cdef readonly int last_reason
    cdef readonly int64_t last_match
    cdef readonly int64_t hits, misses, balanced, evicted_bytes

    def __cinit__(self, array, double cache_threshold=0.3, int64_t balance_abs_threshold=64,
                  double balance_rel_threshold=1.5, int64_t max_tree_size=67108864,
                  uint64_t seed=0, header=None):
        cdef int64_t i
        self._array = array
        if header is None:
            self._hdr = np.zeros(0, dtype=np.int64)
        else:
            self._hdr = header
            if self._hdr.shape[0] < NHDR:
                raise ValueError("not a target table header")
        self._tab = array
        self._nrows = self._tab.shape[0]
        if self._tab.shape[1] != NCOLS:
            raise ValueError("not a target table array")
        self._rows = &self._tab[0, 0] if self._nrows > 0 else NULL
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        if max_tree_size < 1:
            raise ValueError("max_tree_size must be >= 1")
        self.max_tree_size = max_tree_size
        self.rank_slack = -1
        self.rng = seed
        self.free_node = -1
        self.free_ent = -1
        self.free_slot = -1
        self.slot_of = <int32_t *>PyMem_Malloc(self._nrows * sizeof(int32_t))
        if self.slot_of == NULL:
            raise MemoryError()
        for i in range(self._nrows):
            self.slot_of[i] = -1
        self._root()

    cdef int _root(self) except -1:
        # Node 0 is the root: empty label, never held, never freed.
        if self._new_node(-1, NULL, 0) != 0:
            raise RuntimeError("root must be node 0")
        return 0

    def __dealloc__(self):
        # A table closed under the tree (its mapping gone) is not written: its uses stay
        # counted, the safe side (the feed stays on: work for writers, never a stale index).
        if (self._lx_use or self._kx_use) and _mapped(self._array):
            self._feed(&self._lx_use, False)
            self._feed(&self._kx_use, False)
        self._free_all()
        PyMem_Free(self.slot_of)
        PyMem_Free(self.slot_head)
        PyMem_Free(self.slot_tail)
        PyMem_Free(self.slot_size)
        PyMem_Free(self.slot_target)
        PyMem_Free(self.slot_stamp)
        PyMem_Free(self.cand)
        PyMem_Free(self.cand_slot)
        PyMem_Free(self.cand_load)
        PyMem_Free(self.cand_ok)
        PyMem_Free(self.path)
        PyMem_Free(self._changed)

    cdef void _free_all(self) noexcept:
        cdef int32_t i
        if self.nodes != NULL:
            for i in range(self.nnodes_used):
                if self.nodes[i].len >= 0:
                    PyMem_Free(self.nodes[i].base)
                    PyMem_Free(self.nodes[i].kids)
        PyMem_Free(self.nodes)
        PyMem_Free(self.ents)
        self.nodes = NULL
        self.ents = NULL
        self.nnodes_cap = self.nnodes_used = self.live_nodes = 0
        self.nents_cap = self.nents_used = self.live_ents = 0
        self.free_node = -1
        self.free_ent = -1

    # ---- pools ---------------------------------------------------------------------------------
    cdef int32_t _new_node(self, int32_t parent, const unsigned char *src, int64_t n) except -1:
        cdef int32_t x
        cdef Py_ssize_t cap
        cdef Node *nd
        cdef unsigned char *buf = NULL
        if n > 0:
            buf = <unsigned char *>PyMem_Malloc(n)
            if buf == NULL:
                raise MemoryError()
            memcpy(buf, src, n)
        if self.free_node >= 0:
            x = self.free_node
            self.free_node = self.nodes[x].parent
        else:
            if self.nnodes_used == self.nnodes_cap:
                cap = 64 if self.nnodes_cap == 0 else <Py_ssize_t>self.nnodes_cap * 2
                if cap > 0x7FFFFFFF:
                    PyMem_Free(buf)
                    raise MemoryError("prefix tree node pool full")
                nd = <Node *>PyMem_Realloc(self.nodes, cap * sizeof(Node))
                if nd == NULL:
                    PyMem_Free(buf)
                    raise MemoryError()
                self.nodes = nd
                self.nnodes_cap = <int32_t>cap
            x = self.nnodes_used
            self.nnodes_used += 1
        nd = &self.nodes[x]
        nd.base = buf
        nd.label = buf
        nd.len = n
        nd.kids = NULL
        nd.parent = parent
        nd.holders = -1
        nd.nkids = 0
        nd.cap = 0
        self.live_nodes += 1
        return x

    cdef void _free_node(self, int32_t x) noexcept:
        cdef Node *nd = &self.nodes[x]
        PyMem_Free(nd.base)
        PyMem_Free(nd.kids)
        nd.base = nd.label = NULL
        nd.kids = NULL
        nd.len = -1
        nd.nkids = nd.cap = 0
        nd.holders = -1
        nd.parent = self.free_node
        self.free_node = x
        self.live_nodes -= 1

    cdef int32_t _new_entry(self, int32_t node, int32_t slot) except -1:
        cdef int32_t e
        cdef Py_ssize_t cap
        cdef Entry *p
        if self.free_ent >= 0:
            e = self.free_ent
            self.free_ent = self.ents[e].next
        else:
            if self.nents_used == self.nents_cap:
                cap = 64 if self.nents_cap == 0 else <Py_ssize_t>self.nents_cap * 2
                if cap > 0x7FFFFFFF:
                    raise MemoryError("prefix tree entry pool full")
                p = <Entry *>PyMem_Realloc(self.ents, cap * sizeof(Entry))
                if p == NULL:
                    raise MemoryError()
                self.ents = p
                self.nents_cap = <int32_t>cap
            e = self.nents_used
            self.nents_used += 1
        p = &self.ents[e]
        p.node = node
        p.slot = slot
        p.prev = p.next = -1
        p.nnext = -1
        self.live_ents += 1
        return e

    cdef void _free_entry(self, int32_t e) noexcept:
        self.ents[e].node = -1
        self.ents[e].slot = -1
        self.ents[e].next = self.free_ent
        self.free_ent = e
        self.live_ents -= 1

    # ---- children ------------------------------------------------------------------------------
    cdef inline int32_t _kid(self, int32_t x, uint8_t key) noexcept:
        cdef Node *nd = &self.nodes[x]
        cdef uint8_t *keys
        cdef const void *p
        if nd.nkids == 0:
            return -1
        keys = _keys(nd)
        p = memchr(keys, key, nd.nkids)
        if p == NULL:
            return -1
        return nd.kids[<const uint8_t *>p - keys]

    cdef int _add_kid(self, int32_t x, int32_t c, uint8_t key) except -1:
        cdef Node *nd = &self.nodes[x]
        cdef int32_t cap
        cdef int32_t *mem
        if nd.nkids == nd.cap:
            cap = 2 if nd.cap == 0 else nd.cap * 2     # at most 256 kids: one per first byte
            mem = <int32_t *>PyMem_Malloc(cap * (sizeof(int32_t) + 1))
            if mem == NULL:
                raise MemoryError()
            if nd.nkids:
                memcpy(mem, nd.kids, nd.nkids * sizeof(int32_t))
                memcpy(<uint8_t *>(mem + cap), _keys(nd), nd.nkids)
            PyMem_Free(nd.kids)
            nd.kids = mem
            nd.cap = cap
        nd.kids[nd.nkids] = c
        _keys(nd)[nd.nkids] = key
        nd.nkids += 1
        return 0

    cdef void _replace_kid(self, int32_t x, uint8_t key, int32_t c) noexcept:
        cdef Node *nd = &self.nodes[x]
        cdef uint8_t *keys = _keys(nd)
        cdef const void *p = memchr(keys, key, nd.nkids)
        nd.kids[<const uint8_t *>p - keys] = c

    cdef void _remove_kid(self, int32_t x, uint8_t key) noexcept:
        # Swap-remove: children are unordered.  The arrays are freed with the last child.
        cdef Node *nd = &self.nodes[x]
        cdef uint8_t *keys = _keys(nd)
        cdef const void *p = memchr(keys, key, nd.nkids)
        cdef Py_ssize_t i
        if p == NULL:
            return
        i = <const uint8_t *>p - keys
        nd.nkids -= 1
        nd.kids[i] = nd.kids[nd.nkids]
        keys[i] = keys[nd.nkids]
        if nd.nkids == 0:
            PyMem_Free(nd.kids)
            nd.kids = NULL
            nd.cap = 0

    # ---- holders and LRU lists -----------------------------------------------------------------
    cdef inline void _lru_unlink(self, int32_t e) noexcept:
        cdef Entry *p = &self.ents[e]
        if p.prev >= 0:
            self.ents[p.prev].next = p.next
        else:
            self.slot_head[p.slot] = p.next
        if p.next >= 0:
            self.ents[p.next].prev = p.prev
        else:
            self.slot_tail[p.slot] = p.prev
        p.prev = p.next = -1

    cdef inline void _lru_append(self, int32_t e) noexcept:
        cdef Entry *p = &self.ents[e]
        cdef int32_t s = p.slot, t = self.slot_tail[p.slot]
        p.prev = t
        p.next = -1
        if t >= 0:
            self.ents[t].next = e
        else:
            self.slot_head[s] = e
        self.slot_tail[s] = e

    cdef inline void _lru_insert_after(self, int32_t e, int32_t ref) noexcept:
        # e becomes just newer than ref in ref's slot list.
        cdef Entry *p = &self.ents[e]
        cdef int32_t nx = self.ents[ref].next
        p.prev = ref
        p.next = nx
        self.ents[ref].next = e
        if nx >= 0:
            self.ents[nx].prev = e
        else:
            self.slot_tail[p.slot] = e

    cdef int _touch(self, int32_t x, int32_t slot) except -1:
        # Make slot hold x, as its newest entry.  Found holders move to the front of the node's
        # list, so the targets that keep using a shared prefix are found after a step or two.
        cdef int32_t e = self.nodes[x].holders, before = -1
        while e >= 0:
            if self.ents[e].slot == slot:
                if before >= 0:
                    self.ents[before].nnext = self.ents[e].nnext
                    self.ents[e].nnext = self.nodes[x].holders
                    self.nodes[x].holders = e
                if self.slot_tail[slot] != e:
                    self._lru_unlink(e)
                    self._lru_append(e)
                return 0
            before = e
            e = self.ents[e].nnext
        e = self._new_entry(x, slot)
        self.ents[e].nnext = self.nodes[x].holders
        self.nodes[x].holders = e
        self._lru_append(e)
        self.slot_size[slot] += self.nodes[x].len
        return 0

    cdef void _drop_entry(self, int32_t e) noexcept:
        # Remove one holder; free the node if it was the last (then it has no children).
        cdef int32_t x = self.ents[e].node, slot = self.ents[e].slot, f, before = -1
        cdef Node *nd = &self.nodes[x]
        self._lru_unlink(e)
        f = nd.holders
        while f >= 0 and f != e:
            before = f
            f = self.ents[f].nnext
        if before >= 0:
            self.ents[before].nnext = self.ents[e].nnext
        else:
            nd.holders = self.ents[e].nnext
        self.slot_size[slot] -= nd.len
        self._free_entry(e)
        if nd.holders < 0:
            self._remove_kid(nd.parent, nd.label[0])
            self._free_node(x)

    cdef void _evict(self, int32_t slot, int64_t limit) noexcept:
        cdef int64_t before = self.slot_size[slot]
        # The oldest entry of a slot is a leaf for that slot (module docstring), so popping it
        # keeps holding prefix-closed.
        while self.slot_size[slot] > limit and self.slot_head[slot] >= 0:
            self._drop_entry(self.slot_head[slot])
        self.evicted_bytes += before - self.slot_size[slot]

    # ---- slots ---------------------------------------------------------------------------------
    cdef int32_t _slot(self, int64_t target) except -1:
        cdef int32_t s
        cdef Py_ssize_t cap
        if target < 0 or target >= self._nrows:
            raise IndexError(f"target {target} out of range")
        s = self.slot_of[target]
        if s >= 0:
            return s
        if self.free_slot >= 0:
            s = self.free_slot
            self.free_slot = self.slot_head[s]
        else:
            if self.nslots == self.slots_cap:
                cap = 16 if self.slots_cap == 0 else self.slots_cap * 2
                if not (self._grow(<void **>&self.slot_head, cap * sizeof(int32_t))
                        and self._grow(<void **>&self.slot_tail, cap * sizeof(int32_t))
                        and self._grow(<void **>&self.slot_size, cap * sizeof(int64_t))
                        and self._grow(<void **>&self.slot_target, cap * sizeof(int64_t))
                        and self._grow(<void **>&self.slot_stamp, cap * sizeof(uint64_t))):
                    raise MemoryError()
                self.slots_cap = <int32_t>cap
            s = self.nslots
            self.nslots += 1
        self.slot_head[s] = -1
        self.slot_tail[s] = -1
        self.slot_size[s] = 0
        self.slot_target[s] = target
        self.slot_stamp[s] = 0
        self.slot_of[target] = s
        self._cand_obj = None
        return s

    cdef bint _grow(self, void **p, size_t size) noexcept:
        cdef void *q = PyMem_Realloc(p[0], size)
        if q == NULL:
            return False
        p[0] = q
        return True

    cdef void _drop_slot(self, int32_t s) noexcept:
        self._evict(s, -1)
        self.slot_of[self.slot_target[s]] = -1
        self.slot_target[s] = -1
        self.slot_head[s] = self.free_slot     # free-list link while unused
        self.free_slot = s
        self._cand_obj = None
        self.lx.kind = ix.INDEX_NONE
        self._feed(&self._lx_use, False)

    # ---- candidates ----------------------------------------------------------------------------
    cdef int _load_cands(self, targets) except -1:
        cdef Py_ssize_t n = len(targets), i
        cdef int64_t t
        if n > self.cand_cap:
            if not (self._grow(<void **>&self.cand, n * sizeof(int64_t))
                    and self._grow(<void **>&self.cand_slot, n * sizeof(int32_t))
                    and self._grow(<void **>&self.cand_load, n * sizeof(int64_t))
                    and self._grow(<void **>&self.cand_ok, n)):
                raise MemoryError()
            self.cand_cap = n
        self._cand_obj = None
        self.lx.kind = ix.INDEX_NONE      # a new list: indexed from its second pick
        self._feed(&self._lx_use, False)
        self._lx_tried = False
        for i in range(n):
            t = targets[i]
            self.cand[i] = t
            self.cand_slot[i] = self._slot(t)
        self.ncand = n
        self._cand_obj = targets
        return 0

    cdef void _feed(self, bint *held, bint want) noexcept:
        # Take or give back one index's use of the header's feed: writers publish while any
        # index of any process holds one (_layout.feed_publish; Picker._feed_use).  A process
        # that dies holding one leaves the feed on: work for writers, never a stale index.
        if held[0] == want:
            return
        fr_add_i64(&self._hdr[HDR_FEED_ON], 1 if want else -1)   # a read-modify-write
        held[0] = want

    cdef int _index_setup(self) except -1:
        # The current candidates, used a second time: index them when they are many, distinct,
        # and the header's feed can be read (see the field comments).
        cdef int64_t size = 1, i, t, mx = 0
        cdef int64_t[::1] nodes, snodes, leaf_of
        self._lx_tried = True
        if self._hdr.shape[0] == 0 or self.ncand < ix.INDEX_MIN_CANDS:
            return 0
        while size < self.ncand:
            size <<= 1
        for i in range(self.ncand):
            if self.cand[i] > mx:
                mx = self.cand[i]
        leaf_of = np.full(mx + 1, -1, dtype=np.int64)
        for i in range(self.ncand):
            t = self.cand[i]
            if leaf_of[t] >= 0:
                return 0                  # a row listed twice: leaves must be rows of their own
            leaf_of[t] = i
        if self._changed == NULL:
            self._changed = <int64_t *>PyMem_Malloc(HDR_FEED_SLOTS * sizeof(int64_t))
            if self._changed == NULL:
                raise MemoryError()
        nodes = np.zeros(2 * ix.NODE * size, dtype=np.int64)
        snodes = np.zeros(2 * ix.NODE * size, dtype=np.int64)
        self._lx_keep = (nodes, snodes, leaf_of)
        self.lx.kind = ix.INDEX_TREE
        self.lx.size = size
        self.lx.n = self.ncand
        self.lx.weight = 0
        self.lx.mapped = leaf_of.shape[0]
        self.lx.nodes = &nodes[0]
        self.lx.leaf_of = &leaf_of[0]
        self.lx.tab = self._rows
        self.lx.cands = self.cand
        self.lx.header = &self._hdr[0]
        self.sx = self.lx
        self.sx.kind = ix.INDEX_NONE
        self.sx.nodes = &snodes[0]
        self._feed(&self._lx_use, True)   # writers publish from now on; then the rows are read
        ix.index_rebuild(&self.lx)
        self._sx_rebuild()
        return 0

    cdef void _sx_key(self, int64_t leaf, int64_t *k) noexcept:
        # The smallest-tree key of a leaf: bytes held when its load leaf is eligible.
        cdef const int64_t *n = self.lx.nodes + ix.NODE * (self.lx.size + leaf)
        if leaf < self.lx.n and n[3] > 0:
            k[0] = ix.CLS_POLLED
            k[1] = self.slot_size[self.cand_slot[leaf]]
            k[3] = 1
        else:
            k[0] = ix.CLS_NONE
            k[1] = 0
            k[3] = 0
        k[2] = 0
        k[4] = INT64_MIN
        k[5] = 0

    cdef void _sx_rebuild(self) noexcept:
        cdef int64_t leaf
        for leaf in range(self.sx.size):
            self._sx_key(leaf, self.sx.nodes + ix.NODE * (self.sx.size + leaf))
        ix.nodes_build(self.sx.nodes, self.sx.size)

    cdef inline void _sx_update(self, int64_t leaf) noexcept:
        cdef int64_t k[6]
        self._sx_key(leaf, k)
        ix.set_leaf(&self.sx, leaf, k)

    cdef inline int64_t _leaf_of_slot(self, int32_t slot) noexcept:
        cdef int64_t t = self.slot_target[slot]
        if t < 0 or t >= self.lx.mapped:
            return -1
        return self.lx.leaf_of[t]

    cdef inline void _size_changed(self, int32_t slot) noexcept:
        # Once per slot per operation that changed its bytes held (insert, evict).
        cdef int64_t leaf
        if self.lx.kind != ix.INDEX_NONE:
            leaf = self._leaf_of_slot(slot)
            if leaf >= 0:
                self._sx_update(leaf)

    cdef Py_ssize_t _prepare(self, targets, bint scan) except -1:
        # Identity cache: the Group passes the same list object until set_targets replaces it.
        if targets is not self._cand_obj or len(targets) != self.ncand:
            self._load_cands(targets)
        elif self.lx.kind == ix.INDEX_NONE and not self._lx_tried:
            self._index_setup()
        if self.lx.kind != ix.INDEX_NONE and not scan:
            return self._prepare_index()
        return self._prepare_scan()

    cdef Py_ssize_t _prepare_index(self) noexcept:
        # Read the feed (the smallest-tree keys follow the leaves whose eligibility changed);
        # the root holds the least load, how many hold it, and the most.
        cdef int64_t i, count = ix.index_drain_report(&self.lx, self._changed)
        cdef const int64_t *root = self.lx.nodes + ix.NODE
        if count < 0:
            self._sx_rebuild()
        for i in range(count):
            self._sx_update(self._changed[i])
        self.w_index = True
        if root[0] == ix.CLS_NONE:
            return 0
        self.min_load = root[1]
        self.max_load = root[4]
        return root[3]

    cdef Py_ssize_t _prepare_scan(self) noexcept:
        # One pass over the candidates: eligibility (stamped per slot for the tree walk) and the
        # in-flight counts the balance rule and the least-loaded pick read.
        cdef Py_ssize_t i, ne = 0
        cdef const int64_t *row
        cdef int64_t load, mn = INT64_MAX, mx = -1
        self.w_index = False
        self.stamp += 1
        for i in range(self.ncand):
            row = self._rows + self.cand[i] * NCOLS
            if row_eligible(row):
                load = row_requests(row)     # every replica's requests, as the kernels
                self.cand_load[i] = load
                self.cand_ok[i] = 1
                self.slot_stamp[self.cand_slot[i]] = self.stamp
                if load < mn:
                    mn = load
                if load > mx:
                    mx = load
                ne += 1
            else:
                self.cand_ok[i] = 0
        self.min_load = mn
        self.max_load = mx
        if self.rank_slack >= 0 and ne > 0:
            # Bounded load: a candidate above min + slack is not eligible for this pick, for the
            # tree walk (its stamp is cleared) as for the least-loaded choice.
            for i in range(self.ncand):
                if self.cand_ok[i] and self.cand_load[i] > mn + self.rank_slack:
                    self.cand_ok[i] = 0
                    self.slot_stamp[self.cand_slot[i]] = 0
                    ne -= 1
        return ne

    cdef inline bint _ok(self, int32_t slot) noexcept:
        # Whether a slot may be chosen in this pick: stamped by the scan, or, with the index, a
        # candidate whose leaf is eligible (and within the rank slack).
        cdef int64_t leaf
        cdef const int64_t *n
        if not self.w_index:
            return self.slot_stamp[slot] == self.stamp
        leaf = self._leaf_of_slot(slot)
        if leaf < 0:
            return False
        n = self.lx.nodes + ix.NODE * (self.lx.size + leaf)
        return n[3] > 0 and (self.rank_slack < 0 or n[1] <= self.min_load + self.rank_slack)

    cdef inline int64_t _load(self, int32_t slot) noexcept:
        if self.w_index:
            return self.lx.nodes[ix.NODE * (self.lx.size + self._leaf_of_slot(slot)) + 1]
        return row_requests(self._rows + self.slot_target[slot] * NCOLS)

    cdef Py_ssize_t _least_loaded(self) noexcept:
        cdef Py_ssize_t i, best = -1
        cdef int64_t ties = 0
        if self.w_index:            # uniform over the tied minimum, as the reservoir is
            return ix.down_min(self.lx.nodes, self.lx.size, 1,
                               <int64_t>rng_below(&self.rng, <uint64_t>self.lx.nodes[ix.NODE + 3]))
        for i in range(self.ncand):
            if self.cand_ok[i] and self.cand_load[i] == self.min_load:
                if reservoir_step(&self.rng, &ties):      # each tie wins 1/N
                    best = i
        return best

    cdef Py_ssize_t _smallest(self) noexcept:
        cdef Py_ssize_t i, best = -1
        cdef int64_t ties = 0
        cdef int64_t size, best_size = INT64_MAX
        if self.w_index:
            return ix.down_min(self.sx.nodes, self.sx.size, 1,
                               <int64_t>rng_below(&self.rng, <uint64_t>self.sx.nodes[ix.NODE + 3]))
        for i in range(self.ncand):
            if not self.cand_ok[i]:
                continue
            size = self.slot_size[self.cand_slot[i]]
            if size < best_size:
                best_size = size
                best = i
                ties = 1
            elif size == best_size:
                if reservoir_step(&self.rng, &ties):
                    best = i
        return best

    cdef bint _leaf_current(self, int32_t slot) noexcept:
        # The chosen slot's leaf against its row; a stale leaf (a notice lost by a writer that
        # died between its write and its notice) is corrected and the pick is made again by scan.
        cdef int64_t leaf = self._leaf_of_slot(slot)
        cdef int64_t k[6]
        if leaf < 0:
            return False
        ix.leaf_key(&self.lx, self.cand[leaf], k)
        if ix.same(self.lx.nodes + ix.NODE * (self.lx.size + leaf), k):
            return True
        ix.set_leaf(&self.lx, leaf, k)
        self._sx_update(leaf)
        return False

    cdef int32_t _random_holder(self, int32_t x) noexcept:
        cdef int32_t e = self.nodes[x].holders, best = -1
        cdef int64_t ties = 0
        while e >= 0:
            if self._ok(self.ents[e].slot):
                if reservoir_step(&self.rng, &ties):
                    best = self.ents[e].slot
            e = self.ents[e].nnext
        return best

    cdef int32_t _least_loaded_holder(self, int32_t x) noexcept:
        # The holder of x (among this pick's candidates) with the fewest in-flight requests,
        # ties at random.
        cdef int32_t e = self.nodes[x].holders, best = -1, slot
        cdef int64_t ties = 0, load, best_load = INT64_MAX
        while e >= 0:
            slot = self.ents[e].slot
            if self._ok(slot):
                load = self._load(slot)
                if load < best_load:
                    best, best_load, ties = slot, load, 1
                elif load == best_load and reservoir_step(&self.rng, &ties):
                    best = slot
            e = self.ents[e].nnext
        return best

    cdef inline bint _held_by_eligible(self, int32_t x) noexcept:
        cdef int32_t e = self.nodes[x].holders
        while e >= 0:
            if self._ok(self.ents[e].slot):
                return True
            e = self.ents[e].nnext
        return False

    # ---- walk and insert -----------------------------------------------------------------------
    cdef int _walk(self, const unsigned char *s, int64_t n) except -1:
        # Follow s down the tree.  Records the fully matched nodes (path), where the walk
        # stopped (w_node, w_pos, and a partially matched child w_split/w_split_m), and the
        # deepest node held by an eligible candidate with its match length (w_best/w_best_len).
        # Holding is prefix-closed, so once a node has no eligible holder neither has anything
        # below it and the eligibility checks stop.
        cdef int32_t x = 0, c
        cdef int64_t pos = 0, L, m, lim
        cdef bint alive = True
        cdef Node *nd
        self.plen = 0
        self.w_split = -1
        self.w_split_m = 0
        self.w_best = -1
        self.w_best_len = 0
        while pos < n:
            c = self._kid(x, s[pos])
            if c < 0:
                break
            nd = &self.nodes[c]
            L = nd.len
            lim = L if L < n - pos else n - pos
            m = 1 + _common(nd.label + 1, s + pos + 1, lim - 1)   # first byte matched by key
            if alive:
                if self._held_by_eligible(c):
                    self.w_best = c
                    self.w_best_len = pos + m
                else:
                    alive = False
            if m < L:
                self.w_split = c
                self.w_split_m = m
                pos += m
                break
            if self.plen == self.path_cap:
                if not self._grow(<void **>&self.path,
                                  (self.path_cap * 2 + 64) * sizeof(int32_t)):
                    raise MemoryError()
                self.path_cap = self.path_cap * 2 + 64
            self.path[self.plen] = c
            self.plen += 1
            pos += L
            x = c
        self.w_node = x
        self.w_pos = pos
        return 0

    cdef int32_t _split(self, int32_t c, int64_t m) except -1:
        # c's first m bytes become a new node p between c and its parent.  p is held by every
        # holder of c; each new entry sits just newer than c's in that slot's list, which keeps
        # "older than every ancestor" true (byte counts are unchanged: m + (len - m)).
        cdef int32_t p, e, f
        cdef Node *nc
        p = self._new_node(self.nodes[c].parent, self.nodes[c].label, m)   # may move the pool
        nc = &self.nodes[c]
        self._replace_kid(nc.parent, nc.label[0], p)
        nc.parent = p
        nc.label += m
        nc.len -= m
        self._add_kid(p, c, nc.label[0])
        e = self.nodes[c].holders
        while e >= 0:
            f = self._new_entry(p, self.ents[e].slot)
            self.ents[f].nnext = self.nodes[p].holders
            self.nodes[p].holders = f
            self._lru_insert_after(f, e)
            e = self.ents[e].nnext
        return p

    cdef int _insert_walked(self, const unsigned char *s, int64_t n, int32_t slot) except -1:
        # Completes the last _walk for slot: split the partially matched child, hang the
        # unmatched rest as a new leaf, then touch the path bottom-up (deepest oldest).
        cdef int32_t x = self.w_node, leaf
        cdef int64_t pos = self.w_pos
        cdef Py_ssize_t i
        if self.plen + 2 > self.path_cap:
            if not self._grow(<void **>&self.path, (self.plen + 66) * sizeof(int32_t)):
                raise MemoryError()
            self.path_cap = self.plen + 66
        if self.w_split >= 0:
            x = self._split(self.w_split, self.w_split_m)
            self.path[self.plen] = x
            self.plen += 1
        if pos < n:
            leaf = self._new_node(x, s + pos, n - pos)
            self._add_kid(x, leaf, s[pos])
            self.path[self.plen] = leaf
            self.plen += 1
        for i in range(self.plen - 1, -1, -1):
            self._touch(self.path[i], slot)
        if self.slot_size[slot] > self.max_tree_size:
            self._evict(slot, self.max_tree_size)
        self._size_changed(slot)
        return 0

    # ---- Python API ----------------------------------------------------------------------------
    def pick(self, text, targets):
        """The target for a request with this text (None: least in-flight), or -1 when no
        candidate is eligible.  Inserts the text under the chosen target; books nothing."""
        cdef const unsigned char *s = NULL
        cdef Py_ssize_t n, ne
        cdef int32_t slot
        cdef object keep = None
        ne = self._prepare(targets, False)
        if ne == 0:
            self.last_reason = R_NONE
            return -1
        if text is None:
            n = 0
        elif type(text) is str:
            try:
                # No copy for ASCII text; otherwise CPython caches the UTF-8 on the str.
                s = <const unsigned char *>PyUnicode_AsUTF8AndSize(text, &n)
            except UnicodeEncodeError:
                # JSON may carry lone surrogates ("\ud800"); keep them as bytes.
                keep = (<str>text).encode("utf-8", "surrogatepass")
                s = <const unsigned char *>PyBytes_AS_STRING(keep)
                n = PyBytes_GET_SIZE(keep)
        elif type(text) is bytes:
            s = <const unsigned char *>PyBytes_AS_STRING(text)
            n = PyBytes_GET_SIZE(text)
        else:
            raise TypeError(f"text must be str, bytes or None, not {type(text).__name__}")
        slot = self._decide(s, n)
        if self.w_index and not self._leaf_current(slot):
            self.index_fallbacks += 1
            if self._prepare(targets, True) == 0:
                self.last_reason = R_NONE
                return -1
            slot = self._decide(s, n)
        if self.last_reason == R_BALANCE:
            self.balanced += 1
        elif self.last_reason == R_HIT:
            self.hits += 1
        elif self.last_reason != R_NO_TEXT:
            self.misses += 1
        if n > 0:
            self._insert_walked(s, n, slot)
        return self.slot_target[slot]

    cdef int32_t _decide(self, const unsigned char *s, Py_ssize_t n) except -2:
        # The slot a prepared pick chooses for text s[:n] (the three rules); sets last_reason.
        cdef bint imbalanced
        if n == 0:
            self.last_reason = R_NO_TEXT
            self.last_match = 0
            return self.cand_slot[self._least_loaded()]
        self._walk(s, n)
        self.last_match = self.w_best_len
        imbalanced = (self.max_load - self.min_load > self.balance_abs_threshold
                      and <double>self.max_load > <double>self.min_load * self.balance_rel_threshold)
        if imbalanced:
            self.last_reason = R_BALANCE
            return self.cand_slot[self._least_loaded()]
        if self.w_best >= 0 and <double>self.w_best_len > self.cache_threshold * <double>n:
            self.last_reason = R_HIT
            return (self._random_holder(self.w_best) if self.rank_slack < 0
                    else self._least_loaded_holder(self.w_best))
        if self.rank_slack >= 0:
            self.last_reason = R_LEAST
            return self.cand_slot[self._least_loaded()]
        self.last_reason = R_SMALLEST
        return self.cand_slot[self._smallest()]

    def choices(self, text, targets, bint scan=False):
        """(reason, sorted targets) the next pick of this text may choose, drawing and inserting
        nothing; ``scan`` reads the rows as the scan does even when a load index is kept.  For
        tests: the index's choice sets against the scan's, its tie counts against its leaves."""
        cdef bytes b = b"" if text is None else (
            text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text))
        cdef Py_ssize_t n = len(b), i
        cdef int32_t e
        if self._prepare(targets, scan) == 0:
            return R_NONE, []
        if n == 0:
            return R_NO_TEXT, self._least_set()
        self._walk(<const unsigned char *>PyBytes_AS_STRING(b), n)
        if (self.max_load - self.min_load > self.balance_abs_threshold
                and <double>self.max_load > <double>self.min_load * self.balance_rel_threshold):
            return R_BALANCE, self._least_set()
        if self.w_best >= 0 and <double>self.w_best_len > self.cache_threshold * <double>n:
            who = {}
            e = self.nodes[self.w_best].holders
            while e >= 0:
                if self._ok(self.ents[e].slot):
                    who[self.slot_target[self.ents[e].slot]] = self._load(self.ents[e].slot)
                e = self.ents[e].nnext
            if self.rank_slack >= 0:
                low = min(who.values())
                return R_HIT, sorted(t for t, v in who.items() if v == low)
            return R_HIT, sorted(who)
        if self.rank_slack >= 0:
            return R_LEAST, self._least_set()
        if not self.w_index:
            sizes = {self.cand[i]: self.slot_size[self.cand_slot[i]]
                     for i in range(self.ncand) if self.cand_ok[i]}
            low = min(sizes.values())
            return R_SMALLEST, sorted(t for t, v in sizes.items() if v == low)
        return R_SMALLEST, self._tied_leaves(&self.sx)

    cdef list _least_set(self):
        if not self.w_index:
            return sorted(self.cand[i] for i in range(self.ncand)
                          if self.cand_ok[i] and self.cand_load[i] == self.min_load)
        return self._tied_leaves(&self.lx)

    cdef list _tied_leaves(self, ix.Index *x):
        # The leaves holding x's root key, checked against the root's tie count.
        cdef const int64_t *root = x.nodes + ix.NODE
        cdef const int64_t *n
        cdef int64_t leaf
        out = []
        for leaf in range(self.ncand):
            n = x.nodes + ix.NODE * (x.size + leaf)
            if n[3] > 0 and ix.key_cmp(n, root) == 0:
                out.append(self.cand[leaf])
        _require(len(out) == root[3], "load index tie count")
        return sorted(out)

    def kv_all_fit(self, targets, int64_t need):
        """Whether every eligible row of ``targets`` has a known capacity with ``need`` tokens
        of KV free (and one is eligible), from an index of their free KV: KV fit's filter would
        keep them all.  False also when that is not known without a scan: fewer than 64 or
        repeated rows, no header (the caller filters).  ``targets`` is cached by identity."""
        cdef const int64_t *root
        if targets is not self._kx_obj or len(targets) != self.kx.n:
            self._kx_setup(targets)
        if self.kx.kind == ix.INDEX_NONE:
            return False
        ix.index_drain(&self.kx)
        root = self.kx.nodes + ix.NODE
        return root[0] == ix.CLS_POLLED and root[1] >= need

    def kv_check(self, int64_t target, int64_t need):
        """Whether ``target`` is eligible with ``need`` tokens of KV free, read from its row;
        a leaf of the free-KV index that disagrees with the row (a lost notice) is corrected."""
        cdef int64_t leaf
        cdef int64_t k[6]
        if not 0 <= target < self._nrows:
            raise IndexError(f"target {target} out of range")
        if self.kx.kind != ix.INDEX_NONE and target < self.kx.mapped and self.kx.leaf_of[target] >= 0:
            leaf = self.kx.leaf_of[target]
            ix.leaf_key(&self.kx, target, k)
            ix.set_leaf(&self.kx, leaf, k)
        return row_eligible(self._rows + target * NCOLS) and row_kv_free(self._rows + target * NCOLS) >= need

    cdef int _kx_setup(self, targets) except -1:
        cdef int64_t size = 1, i, t, n = len(targets)
        cdef int64_t[::1] nodes, leaf_of, cands
        self._kx_obj = targets
        self._kx_keep = None
        self.kx.kind = ix.INDEX_NONE
        self._feed(&self._kx_use, False)
        self.kx.n = n
        if self._hdr.shape[0] == 0 or n < ix.INDEX_MIN_CANDS:
            return 0
        cands = np.asarray(targets, dtype=np.int64).copy()
        if np.unique(cands).shape[0] != n or cands[np.argmin(cands)] < 0 or cands[np.argmax(cands)] >= self._nrows:
            return 0
        while size < n:
            size <<= 1
        leaf_of = np.full(int(np.max(cands)) + 1, -1, dtype=np.int64)
        np.asarray(leaf_of)[cands] = np.arange(n, dtype=np.int64)
        nodes = np.zeros(2 * ix.NODE * size, dtype=np.int64)
        self._kx_keep = (nodes, leaf_of, cands)
        self.kx.kind = ix.INDEX_LEAST_FREE
        self.kx.size = size
        self.kx.weight = 0
        self.kx.mapped = leaf_of.shape[0]
        self.kx.nodes = &nodes[0]
        self.kx.leaf_of = &leaf_of[0]
        self.kx.tab = self._rows
        self.kx.cands = &cands[0]
        self.kx.header = &self._hdr[0]
        self._feed(&self._kx_use, True)
        ix.index_rebuild(&self.kx)
        return 0

    @property
    def indexed(self):
        """Whether the current candidates are read through the load index (else scanned)."""
        return self.lx.kind != ix.INDEX_NONE

    @property
    def index_rebuilds(self):
        """Times the load index was built from the rows (new candidates, or behind the feed)."""
        return self.lx.rebuilds

    def match(self, text, targets):
        """(match length in bytes, sorted eligible targets holding the longest match); no insert."""
        cdef bytes b = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
        cdef int32_t e
        out = []
        self._prepare(targets, False)
        self._walk(<const unsigned char *>PyBytes_AS_STRING(b), len(b))
        if self.w_best < 0:
            return 0, out
        e = self.nodes[self.w_best].holders
        while e >= 0:
            if self._ok(self.ents[e].slot):
                out.append(self.slot_target[self.ents[e].slot])
            e = self.ents[e].nnext
        return self.w_best_len, sorted(out)

    def insert(self, text, int64_t target):
        """Record text as held by target (as a pick that chose it would)."""
        cdef bytes b = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else bytes(text)
        cdef int32_t slot = self._slot(target)
        self.stamp += 1
        self.w_index = False                      # the walk marks nothing as eligible
        if len(b):
            self._walk(<const unsigned char *>PyBytes_AS_STRING(b), len(b))
            self._insert_walked(<const unsigned char *>PyBytes_AS_STRING(b), len(b), slot)

    def set_targets(self, targets):
        """Keep the trees of these targets, drop every other target's entries."""
        keep = set(int(t) for t in targets)
        cdef int32_t s
        for s in range(self.nslots):
            if self.slot_target[s] >= 0 and self.slot_target[s] not in keep:
                self._drop_slot(s)
        for t in keep:
            self._slot(t)
        self._cand_obj = None

    def drop(self, int64_t target):
        """Forget target's entries (removed, or its row now belongs to another worker)."""
        if 0 <= target < self._nrows and self.slot_of[target] >= 0:
            self._drop_slot(self.slot_of[target])

    def evict(self, limit=None):
        """Evict every target down to limit bytes (default max_tree_size); returns bytes freed."""
        cdef int64_t lim = self.max_tree_size if limit is None else limit
        cdef int64_t before = self.evicted_bytes
        cdef int32_t s
        for s in range(self.nslots):
            if self.slot_target[s] >= 0:
                self._evict(s, lim)
                self._size_changed(s)
        return self.evicted_bytes - before

    def size(self, int64_t target):
        """Bytes of text held by target (0 if unknown)."""
        if 0 <= target < self._nrows and self.slot_of[target] >= 0:
            return self.slot_size[self.slot_of[target]]
        return 0

    def sizes(self):
        """{target: bytes held} for every known target."""
        cdef int32_t s
        return {self.slot_target[s]: self.slot_size[s] for s in range(self.nslots)
                if self.slot_target[s] >= 0}

    @property
    def node_count(self):
        """Live nodes, the root included."""
        return self.live_nodes

    @property
    def entry_count(self):
        """Live (node, target) holdings."""
        return self.live_ents

    def clear(self):
        """Empty the tree; targets stay known."""
        cdef int32_t s
        self._free_all()
        for s in range(self.nslots):
            if self.slot_target[s] >= 0:          # a free slot's head is its free-list link
                self.slot_head[s] = -1
                self.slot_tail[s] = -1
                self.slot_size[s] = 0
        self._root()
        if self.lx.kind != ix.INDEX_NONE:
            self._sx_rebuild()

    def check(self):
        """Verify every structural invariant, raising TreeCorrupt on the first broken one;
        returns {target: bytes held} recomputed from the nodes.  O(nodes x targets): tests and
        debugging only."""
        cdef int32_t x, e, f, s, c, k, count
        cdef int64_t pos
        cdef Node *nd
        sizes = {}
        order = {}
        for s in range(self.nslots):
            if self.slot_target[s] < 0:
                continue
            sizes[self.slot_target[s]] = 0
            e = self.slot_head[s]
            pos = 0
            prev = -1
            while e >= 0:
                _require(self.ents[e].slot == s, "entry in another slot's list")
                _require(self.ents[e].prev == prev, "broken LRU back link")
                order[e] = pos
                pos += 1
                prev = e
                e = self.ents[e].next
            _require(self.slot_tail[s] == prev, "slot tail is not the last entry")
        live = 0
        for x in range(self.nnodes_used):
            nd = &self.nodes[x]
            if nd.len < 0:
                continue
            live += 1
            if x == 0:
                _require(nd.holders < 0 and nd.len == 0, "root is held or labelled")
            else:
                _require(nd.len > 0, "empty label")
                _require(nd.holders >= 0, "node without holders")
                _require(self._kid(nd.parent, nd.label[0]) == x, "parent does not list node")
            for k in range(nd.nkids):
                c = nd.kids[k]
                _require(self.nodes[c].parent == x, "child's parent link")
                _require(self.nodes[c].label[0] == _keys(nd)[k], "child key")
            e = nd.holders
            count = 0
            seen = set()
            while e >= 0:
                s = self.ents[e].slot
                _require(self.ents[e].node == x, "holder of another node")
                _require(s not in seen, "slot holds a node twice")
                _require(e in order, "holder missing from its slot's LRU list")
                seen.add(s)
                t = self.slot_target[s]
                sizes[t] += nd.len
                if nd.parent > 0:
                    f = self.nodes[nd.parent].holders
                    while f >= 0 and self.ents[f].slot != s:
                        f = self.ents[f].nnext
                    _require(f >= 0, "holding is not prefix-closed")
                    _require(order[f] > order[e], "ancestor older than descendant in LRU")
                e = self.ents[e].nnext
                count += 1
        _require(live == self.live_nodes, "live node count")
        _require(len(order) == self.live_ents, "live entry count")
        for s in range(self.nslots):
            if self.slot_target[s] >= 0:
                _require(sizes[self.slot_target[s]] == self.slot_size[s], "size accounting")
        return sizes
