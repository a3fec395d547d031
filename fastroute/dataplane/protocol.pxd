# Augmenting declarations for the compiled build of protocol.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
from fastroute.dataplane._clock cimport monotonic
from fastroute.dataplane.endpoints cimport Endpoints
from fastroute.dataplane.flow cimport FlowControl
from fastroute.dataplane.limits cimport Limits
from fastroute.dataplane.live cimport Live
from fastroute.dataplane.request cimport Request
from fastroute.dataplane.telemetry cimport Telemetry
from fastroute.dataplane.wire cimport ClientSide, status_line

cdef class ClientProtocol(ClientSide):
    cdef readonly Endpoints endpoints
    cdef public Limits limits
    cdef public Live live
    cdef public Telemetry tel
    cdef public object transport, parser
    cdef dict _flags
    cdef public bint busy, draining
    cdef bint _conn
    cdef bint bad_request, in_head, head_only, _expect
    cdef readonly object queue
    cdef public double head_deadline, http_t0
    cdef readonly Request _req
    cdef public object waiter, http_key
    cdef object _url
    cdef object _fwd, _chunks, _rid_vals, _key_vals, _body_check
    cdef object _bad_message, _cl
    cdef Py_ssize_t _head_size, _head_bytes, _bad_status

    # Per request, from this class and from the typed exchanges: C calls.
    cpdef _start(self, req)
    cpdef response_done(self, keep_alive)
    cpdef write(self, data)
    cpdef done(self, keep_alive)
    cpdef fail(self, exc, req, sse=*, model=*)
    cpdef abort(self)
