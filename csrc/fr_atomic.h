/* fr_atomic.h: lock-free int64 counters shared between fastroute processes.
 *
 * The target table lives in POSIX shared memory and is written by several proxy processes
 * (book/release) and by the load monitor (polled values).  Every access to a shared cell goes
 * through these wrappers so the compiler can neither tear nor cache it.
 *
 * Memory ordering: counters are independent statistics, not locks guarding other data, so plain
 * loads use acquire (a free `mov` on x86-64, a cheap `ldar` on arm64) and read-modify-writes use
 * acq_rel.  A pick may read a counter that another process changes a nanosecond later; that is
 * inherent to lock-free least-load selection and bounded by one request per concurrent pick.
 */
#ifndef FR_ATOMIC_H
#define FR_ATOMIC_H

#include <stdint.h>

static inline int64_t fr_load_i64(const int64_t *p) {
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}

static inline void fr_store_i64(int64_t *p, int64_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

/* Returns the value before the addition. */
static inline int64_t fr_add_i64(int64_t *p, int64_t v) {
    return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
}

/* Returns the value before the subtraction. */
static inline int64_t fr_sub_i64(int64_t *p, int64_t v) {
    return __atomic_fetch_sub(p, v, __ATOMIC_ACQ_REL);
}

/* On failure *expected is updated to the current value; returns 1 on success, 0 on failure. */
static inline int fr_cas_i64(int64_t *p, int64_t *expected, int64_t desired) {
    return __atomic_compare_exchange_n(p, expected, desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

#endif /* FR_ATOMIC_H */
