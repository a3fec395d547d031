# Augmenting declarations for the compiled build of wire.py (Cython pure-Python mode; see
# setup.py): ClientSide becomes an extension type whose methods the typed exchanges call in C,
# and the wire functions C calls. The .py stays the source; keep both in step.
from fastroute.dataplane._ids cimport request_id
from fastroute.dataplane.flow cimport FlowControl

cdef dict _STATUS  # status -> prebuilt status line (status_line: one dict call)
cdef dict _RID_PREFIX  # path -> request id prefix (a C global: one dict call per id)

cpdef bytes new_request_id(path)
cpdef bytes status_line(code)

cdef class ClientSide:
    cdef readonly FlowControl flow
    cdef public bint closed
    cdef public object exchange

    cpdef write(self, data)
    cpdef done(self, keep_alive)
    cpdef fail(self, exc, req, sse=*, model=*)
    cpdef abort(self)
