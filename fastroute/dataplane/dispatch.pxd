# Augmenting declarations for the compiled build of dispatch.py (Cython pure-Python mode; see
# setup.py): Dispatcher becomes an extension type, its fields a C struct, and its per-request
# methods C-callable from the protocol and the exchanges (which type their ``dispatch`` as one). The .py
# stays the source and runs as it is when not compiled; keep both in step.
cimport cython

from fastroute.dataplane._splice cimport target_path
from fastroute.dataplane.admission cimport Admission
from fastroute.dataplane.body cimport RequestMeta, parse_request
from fastroute.dataplane.request cimport Request
from fastroute.dataplane.telemetry cimport Telemetry

cdef class Dispatcher:
    cdef public Admission admission
    cdef public Telemetry tel
    cdef public object loop, registry, breakers, cors, api_key, config
    cdef public object room_rng, backend, model_role, exchange_cls, max_attempts
    cdef public dict header_flags
    cdef public object rid_headers, key_headers
    cdef public dict routes
    cdef public set exchanges, connections
    cdef public dict handshaking
    cdef public Py_ssize_t max_payload
    cdef public double timeout, header_timeout, idle_timeout, sse_keepalive
    cdef public bint accepting, pd, igw, guarded
    cdef public object owner, retry_rng, tokens
    cdef public double backoff_initial, backoff_max, backoff_mult, backoff_jitter
    cdef dict _groups

    cpdef handle(self, proto, Request req)
    @cython.locals(meta=RequestMeta)
    cpdef proxy(self, proto, Request req, path)
    cpdef admit(self, proto, req, path, meta)
    cpdef begin(self, proto, req, path, meta)
    cpdef group(self, role)
