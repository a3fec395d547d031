# Augmenting declarations for the compiled build of pd.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
cimport cython

from fastroute.dataplane.body cimport bootstrap_fields, splice_point
from fastroute.dataplane.exchange cimport _Exchange
from fastroute.dataplane.route cimport Route
from fastroute.dataplane.upstream cimport Leg

cdef class _PDLeg

cdef class PDRelay(_Exchange):
    cdef public _PDLeg p, d
    cdef object merger
    cdef readonly bint stream, merge, relaying

    @cython.locals(p_route=Route, d_route=Route, p=_PDLeg, d=_PDLeg)
    cpdef attempt(self)
    cpdef _abort_legs(self)
    cpdef _close_books(self)
    cpdef pd_progress(self)
    cpdef observe_ttft(self)
    cpdef relay_body(self, data)
    cpdef relay_end(self)
    cpdef leg_failed(self, leg, exc, connect_failed=*)
    cpdef drop_merge(self, leg)

cdef class _PDLeg(Leg):
    cdef readonly PDRelay ex
    cdef public object headers, chunks
    cdef readonly object role
    cdef public Py_ssize_t status, size, target
    cdef public bint done

    cpdef up_head(self, status, headers)
    cpdef up_body(self, data)
    cpdef up_done(self)
    cpdef up_error(self, exc)
    cpdef up_flush(self)
