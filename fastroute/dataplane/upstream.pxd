# Augmenting declarations for the compiled build of upstream.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
cdef class Leg:
    cpdef up_head(self, status, headers)
    cpdef up_body(self, data)
    cpdef up_done(self)
    cpdef up_error(self, exc)
    cpdef up_flush(self)

cdef class UpstreamConnection:
    cdef public Leg leg
    cdef public object pool, transport, parser, request, body, headers, connect_task
    cdef public bint reused, got_bytes, head_done, keep_alive, closed, paused, interim, pooled
    cdef public Py_ssize_t status
    cdef public double idle_since

    cpdef _write_request(self, transport)

cdef class Pool:
    cdef public object host, port, loop, _sweep_handle, ssl
    cdef public list idle
    cdef public set busy
    cdef public double idle_timeout
    cdef public bint closed
