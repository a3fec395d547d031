# Augmenting declarations for the compiled build of live.py (Cython pure-Python mode; see
# setup.py): Live becomes an extension type, its sets C fields of the typed protocol and
# exchanges. The .py stays the source; keep both in step.
cdef class Live:
    cdef public set connections
    cdef readonly set exchanges
    cdef readonly dict handshaking
    cdef public bint accepting
