# Augmenting declarations for the compiled build of protocol.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
from fastroute.dataplane._clock cimport monotonic
from fastroute.dataplane._ids cimport request_id
from fastroute.dataplane.dispatch cimport Dispatcher
from fastroute.dataplane.flow cimport FlowControl
from fastroute.dataplane.request cimport Request

cdef class ClientProtocol:
    cdef public Dispatcher dispatch
    cdef public object transport, parser
    cdef public dict _flags
    cdef public bint closed, busy, draining, bad_request, in_head, head_only, _expect, _conn
    cdef public object queue, exchange
    cdef public FlowControl flow
    cdef public double head_deadline, http_t0
    cdef public Request _req
    cdef public object _url, _fwd, _chunks, _rid_vals, _key_vals, _body_check, waiter, http_key
    cdef public object _bad_message, _cl
    cdef public Py_ssize_t _head_size, _head_bytes, _bad_status

    # Per request, from this class and from the typed exchanges: C calls.
    cpdef _start(self, req)
    cpdef response_done(self, keep_alive)

cdef dict _RID_PREFIX  # path -> request id prefix (a C global: one dict call per id)
cdef dict _STATUS  # status -> prebuilt status line (status_line: one dict call)

cpdef bytes new_request_id(path)
cpdef bytes status_line(code)
