# Augmenting declarations for the compiled build of exchange.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
cimport cython

from fastroute.dataplane._clock cimport monotonic
from fastroute.dataplane._splice cimport chunk, copied_headers, joined
from fastroute.dataplane.admission cimport Admission
from fastroute.dataplane.body cimport RequestMeta
from fastroute.dataplane.limits cimport Limits
from fastroute.dataplane.live cimport Live
from fastroute.dataplane.request cimport Request
from fastroute.dataplane.route cimport Route
from fastroute.dataplane.telemetry cimport Telemetry
from fastroute.dataplane.upstream cimport Leg
from fastroute.dataplane.upstreams cimport Upstreams
from fastroute.dataplane.wire cimport ClientSide, new_request_id, status_line

cdef class _Exchange(Leg):
    cdef public ClientSide client
    cdef readonly Request req
    cdef public RequestMeta meta
    cdef readonly Upstreams upstreams
    cdef public Limits limits
    cdef public Live live
    cdef public Telemetry tel
    cdef readonly Admission admission
    cdef public object leases, rid, path
    cdef readonly object retry_handle
    cdef object head
    cdef public list out
    cdef public double deadline
    cdef readonly double started_at
    cdef readonly double ka_due
    cdef public bint chunked, keep_alive, slot
    cdef readonly bint finished
    cdef bint started, gave_up, ka_sent
    cdef public Py_ssize_t status
    cdef readonly Py_ssize_t tries

    # Called on self (and by the PD legs on their typed exchange): C calls, not Python ones.
    cpdef _init(self, client, req, path, meta, upstreams, limits, live, tel, admission)
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
