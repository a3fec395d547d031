# Augmenting declarations for the compiled build of exchange.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
cimport cython

from fastroute.dataplane._clock cimport monotonic
from fastroute.dataplane._splice cimport chunk, copied_headers, joined
from fastroute.dataplane.body cimport RequestMeta
from fastroute.dataplane.dispatch cimport Dispatcher
from fastroute.dataplane.protocol cimport ClientProtocol, new_request_id, status_line
from fastroute.dataplane.request cimport Request
from fastroute.dataplane.route cimport Route
from fastroute.dataplane.upstream cimport Leg

cdef class _Exchange(Leg):
    cdef public ClientProtocol proto
    cdef public Request req
    cdef public RequestMeta meta
    cdef public Dispatcher dispatch
    cdef public object leases, head, rid, path, retry_handle
    cdef public list out
    cdef public double deadline, started_at, ka_due
    cdef public bint chunked, started, finished, keep_alive, slot, gave_up, ka_sent
    cdef public Py_ssize_t status, tries

    # Called on self (and by the PD legs on their typed exchange): C calls, not Python ones.
    cpdef _setup(self, dispatch, proto, req, path, meta)
    cpdef _outcome(self, target, result)
    cpdef _start_response(self, status, headers, length=*, ctype=*)
    cpdef _write(self, data)
    cpdef flush(self)
    cpdef up_flush(self)
    cpdef _end(self)
    cpdef _release_leases(self)
    cpdef _close_books(self)
    cpdef _finish(self, keep_alive, error=*, sse=*)
    cpdef _fail_client(self, exc, sse=*)
    cpdef bint can_retry(self)
    cpdef bint fits(self, double wait)
    cpdef retry_later(self, role, double wait=*)
    cpdef exhausted(self, role)
    cpdef attempt(self)
    cpdef fail_internal(self)
    cpdef _abort_legs(self)

cdef class Relay(_Exchange):
    cdef public Py_ssize_t target

    @cython.locals(route=Route)
    cpdef attempt(self)
    cpdef _abort_legs(self)
    cpdef up_head(self, status, headers)
    cpdef up_body(self, data)
    cpdef up_done(self)
    cpdef up_error(self, exc)
