# Augmenting declarations for the compiled build of request.py (Cython pure-Python mode; see
# setup.py): Request becomes an extension type, its attributes a C struct, cimported by the
# protocol, the dispatcher, the routes and the exchanges. The .py stays the source; keep both in step.

cdef class Request:
    cdef public object method, url, fwd, auth, rid, key, body, body_len
    cdef public bint too_large, keep_alive, http11
    cdef public object origin, acrh
    cdef object __weakref__
