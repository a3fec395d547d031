"""The histogram the request path observes into, compiled: one observation is a scan of a C
array of bucket bounds and two additions, called through the type's vtable from the compiled
telemetry (dataplane/telemetry.py). As plain Python objects (a bisect over a tuple, the count
list item and the float sum re-boxed) the five histograms of a PD request cost ~10k
instructions, 6% of the request.

``bounds`` (sorted floats), ``counts`` (a list, one more than the bounds: the last is +Inf) and
``sum`` are the fields control/metrics.py reads and merges (``counts`` item by item: the list
itself cannot be replaced, since observe indexes it without a bounds check); a Hist pickles as
those three (``--workers N`` sends each proxy's histograms to the supervisor).
"""

from libc.stdlib cimport free, malloc

from fastroute.config import DEFAULT_DURATION_BUCKETS


cdef class Hist:
    """A fixed-bucket histogram, no locking (one process, one event loop); buckets are
    cumulated at scrape time. An observation lands in the first bucket whose bound is >= it."""

    def __init__(self, bounds=None):
        cdef Py_ssize_t i
        self.bounds = tuple(sorted(float(b) for b in (DEFAULT_DURATION_BUCKETS if bounds is None else bounds)))
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        free(self.edges)
        self.n = len(self.bounds)
        self.edges = <double *>malloc((self.n + 1) * sizeof(double))
        if self.edges == NULL:
            raise MemoryError()
        for i in range(self.n):
            self.edges[i] = self.bounds[i]

    def __dealloc__(self):
        free(self.edges)

    cpdef observe(self, double v):
        cdef Py_ssize_t i = 0
        while i < self.n and self.edges[i] < v:
            i += 1
        self.counts[i] += 1
        self.sum += v

    def buckets(self):
        """(upper bound label, cumulative count) per bucket, ending with +Inf."""
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):
            acc += c
            out.append((repr(b), acc))
        out.append(("+Inf", acc + self.counts[self.n]))  # (no negative index: wraparound is off)
        return out

    @property
    def count(self):
        return sum(self.counts)

    def __reduce__(self):
        return (_rebuild, (self.bounds, self.counts, self.sum))


def _rebuild(bounds, counts, total):
    cdef Hist h = Hist(bounds)
    if len(counts) != h.n + 1:  # observe indexes counts unchecked: never a list of another size
        raise ValueError("histogram counts do not match its bounds")
    h.counts = list(counts)
    h.sum = total
    return h
