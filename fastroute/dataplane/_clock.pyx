"""The request path's clock, compiled: CLOCK_MONOTONIC read in C.

``time.perf_counter()`` (the metrics' durations) and a loop's ``time()`` (the pools' idle
ages) are Python calls: a lookup, a call, a boxed float, ~200-300 instructions each, several
per request. ``monotonic()`` is the same clock perf_counter reads on Linux, read by one
clock_gettime (vDSO, no system call). Values from it are compared only with values from it.
"""

from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec


cpdef double monotonic() noexcept:
    """Seconds of CLOCK_MONOTONIC (an arbitrary start; for differences only)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <double>ts.tv_sec + <double>ts.tv_nsec * 1e-9
