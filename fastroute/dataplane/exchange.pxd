# Augmenting declarations for the compiled build of exchange.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
from fastroute.dataplane.body cimport RequestMeta
from fastroute.dataplane.front cimport Front
from fastroute.dataplane.protocol cimport ClientProtocol, Request

cdef class _Exchange:
    cdef public ClientProtocol proto
    cdef public Request req
    cdef public RequestMeta meta
    cdef public Front app
    cdef public object leases, head, rid, out, path, retry_handle
    cdef public double deadline, started_at, ka_due
    cdef public bint chunked, started, finished, keep_alive, slot, gave_up, ka_sent
    cdef public Py_ssize_t status, tries

cdef class Relay(_Exchange):
    cdef public object conn
    cdef public Py_ssize_t target
