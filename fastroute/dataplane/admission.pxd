# Augmenting declarations for the compiled build of admission.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct, and the
# per-request gate (try_enter, leave) C calls from the endpoints. The .py stays the source and runs as
# it is when not compiled; keep both in step.
from fastroute.dataplane.telemetry cimport Telemetry

cdef class Waiter:
    cdef readonly object start, expired
    cdef public double deadline

cdef class Admission:
    cdef readonly bint enabled
    cdef readonly Py_ssize_t queue_size, active
    cdef Py_ssize_t limit
    cdef public double tokens
    cdef readonly double capacity
    cdef readonly double rate, queue_timeout
    cdef double _at
    cdef readonly object loop
    cdef readonly object queue
    cdef object _wake
    cdef public Telemetry tel

    cpdef bint try_enter(self)
    cpdef leave(self)
