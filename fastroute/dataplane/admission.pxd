# Augmenting declarations for the compiled build of admission.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct, and the
# per-request gate (try_enter, leave) C calls from the Dispatcher. The .py stays the source and runs as
# it is when not compiled; keep both in step.
from fastroute.dataplane.telemetry cimport Telemetry

cdef class Waiter:
    cdef public object start, expired
    cdef public double deadline

cdef class Admission:
    cdef public bint enabled
    cdef public Py_ssize_t limit, queue_size, active
    cdef public double rate, capacity, tokens, _at, queue_timeout
    cdef public object _wake, loop, queue
    cdef public Telemetry tel

    cpdef bint try_enter(self)
    cpdef leave(self)
