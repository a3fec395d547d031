# Augmenting declarations for the compiled build of route.py (Cython pure-Python mode; see
# setup.py): Route becomes an extension type, its fields a C struct. The .py stays the source
# and runs as it is when not compiled; keep both in step.
from fastroute.dataplane._splice cimport framed, post_head
from fastroute.dataplane.request cimport Request
from fastroute.dataplane.upstream cimport Pool

cdef class Route:
    cdef readonly Pool pool
    cdef bytes host_part
    cdef public object worker, authority, auth, prefill_rank
    cdef readonly object rank_field
    cdef readonly object bootstrap, prefill_dp_size
    cdef public object port
    cdef readonly object index
    cdef readonly object prefill_rank_field

    cdef bytes frame(self, Request req, Py_ssize_t length)
    cpdef send_injected(self, Request req, Py_ssize_t end, bytes sep, bytes fields, leg)
    cpdef send(self, Request req, leg)
