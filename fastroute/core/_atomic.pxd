# Declarations of csrc/fr_atomic.h, the only way compiled fastroute code touches a shared counter.
from libc.stdint cimport int64_t

cdef extern from "fr_atomic.h" nogil:
    int64_t fr_load_i64(const int64_t *p)
    void fr_store_i64(int64_t *p, int64_t v)
    int64_t fr_add_i64(int64_t *p, int64_t v)
    int64_t fr_sub_i64(int64_t *p, int64_t v)
    bint fr_cas_i64(int64_t *p, int64_t *expected, int64_t desired)
