# Augmenting declarations for the compiled build of upstreams.py (Cython pure-Python mode; see
# setup.py): Upstreams becomes an extension type; the exchanges read its routes and call its
# per-attempt methods in C. The .py stays the source; keep both in step.
from fastroute.dataplane.telemetry cimport Telemetry

cdef class Upstreams:
    cdef readonly dict routes
    cdef readonly object room_rng
    cdef public Telemetry tel
    cdef public object stats
    cdef object worker_tls
    cdef object _registry, _breakers, _loop
    cdef object _roles, _route
    cdef public object _api_key
    cdef object _rank_field, _retry_rng
    cdef readonly dict _groups
    cdef dict _pools, _row_owner
    cdef double _pool_idle, _backoff_initial, _backoff_max, _backoff_mult, _backoff_jitter

    cpdef group(self, role)
    cpdef outcome(self, target, result)
    cpdef retry_later(self, Py_ssize_t retry, double wait, callback)
