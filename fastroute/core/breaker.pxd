# Augmenting declarations for the compiled build of breaker.py (Cython pure-Python mode; see
# setup.py): Breakers becomes an extension type, its fields a C struct, and the per-response
# outcome path (status -> success / failure) C calls inside it. The .py stays the source and
# runs as it is when not compiled; keep both in step.
cimport cython

cdef class Breakers:
    cdef public object stats
    cdef readonly object table
    cdef readonly object clock, cells
    cdef readonly object name_of
    cdef list _ok_key, _fail_key
    cdef readonly bint enabled
    cdef Py_ssize_t failure_threshold, success_threshold, _timeout_us
    cdef readonly Py_ssize_t capacity
    cdef public double timeout

    @cython.locals(d=dict)
    cpdef success(self, t)
    @cython.locals(d=dict)
    cpdef failure(self, t)
    cpdef status(self, t, status)
