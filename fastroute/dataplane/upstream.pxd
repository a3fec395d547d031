# Augmenting declarations for the compiled build of upstream.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
cimport cython

from fastroute.dataplane._clock cimport monotonic

cdef class Leg:
    cdef public object conn

    cpdef up_head(self, status, headers)
    cpdef up_body(self, data)
    cpdef up_done(self)
    cpdef up_error(self, exc)
    cpdef up_flush(self)

cdef class Pool

cdef class UpstreamConnection:
    cdef public Leg leg
    cdef readonly Pool pool
    cdef public object transport, parser, request, body, headers, connect_task
    cdef public bint reused, got_bytes, head_done, keep_alive, closed, paused, pooled
    cdef bint interim
    cdef public Py_ssize_t status
    cdef public double idle_since

    cpdef _write_request(self, transport)

cdef class Pool:
    cdef public object host, port
    cdef readonly object loop
    cdef object _sweep_handle, ssl
    cdef readonly list idle
    cdef public set busy
    cdef readonly double idle_timeout
    cdef public bint closed

    # Per leg: C calls from the routes and the connections, and the connections they hand out
    # and take back typed (their fields are C struct members, not attribute lookups).
    @cython.locals(conn=UpstreamConnection, c=UpstreamConnection)
    cpdef send(self, request, Leg leg, bint fresh=*, body=*)
    cpdef release(self, UpstreamConnection conn)
    cpdef discard(self, UpstreamConnection conn)
