# Augmenting declarations for the compiled build of limits.py (Cython pure-Python mode; see
# setup.py): Limits becomes an extension type whose settings the typed protocol, endpoints and
# exchanges read as C fields. The .py stays the source; keep both in step.
cdef class Limits:
    cdef readonly Py_ssize_t max_payload
    cdef readonly Py_ssize_t max_attempts, pd_max_batch_size
    cdef public double timeout
    cdef readonly double header_timeout, body_timeout, idle_timeout, sse_keepalive
    cdef readonly bint guarded
    cdef readonly object cors
    cdef readonly dict header_flags
    cdef readonly tuple key_headers
    cdef readonly tuple rid_headers
