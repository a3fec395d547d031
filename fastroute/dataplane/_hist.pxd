# Declarations of fastroute.dataplane._hist for cimport (dataplane/telemetry.pxd observes through
# the vtable).
cdef class Hist:
    cdef readonly tuple bounds
    cdef readonly list counts
    cdef public double sum
    cdef double *edges
    cdef Py_ssize_t n

    cpdef observe(self, double v)
