# Augmenting declarations for the compiled build of endpoints.py (Cython pure-Python mode; see
# setup.py): Endpoints becomes an extension type, its fields a C struct, and the per-request
# methods C calls from the typed protocol. The .py stays the source; keep both in step.
cimport cython

from fastroute.dataplane._splice cimport target_path
from fastroute.dataplane.admission cimport Admission
from fastroute.dataplane.body cimport RequestMeta, parse_request
from fastroute.dataplane.exchange cimport Relay
from fastroute.dataplane.limits cimport Limits
from fastroute.dataplane.live cimport Live
from fastroute.dataplane.pd cimport PDRelay
from fastroute.dataplane.request cimport Request
from fastroute.dataplane.telemetry cimport Telemetry
from fastroute.dataplane.upstreams cimport Upstreams

cdef class Endpoints:
    cdef public Telemetry tel
    cdef public object tokens
    cdef public bint draining
    cdef readonly set admin_tasks
    cdef public object exchange
    cdef Limits _limits
    cdef Upstreams _upstreams
    cdef Live _live
    cdef Admission _admission
    cdef object _registry, _loop
    cdef public object _api_key
    cdef object _admin_auth, _model_role
    cdef bint _audit
    cdef bint _pd, _igw

    cpdef handle(self, proto, Request req)
    @cython.locals(meta=RequestMeta)
    cpdef proxy(self, proto, Request req, path)
    cpdef admit(self, proto, req, path, meta)
    cpdef begin(self, proto, req, path, meta)
