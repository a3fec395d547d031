# Augmenting declarations for the compiled build of pd.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
from fastroute.dataplane.exchange cimport _Exchange

cdef class PDRelay(_Exchange):
    cdef public object p, d, merger
    cdef public bint stream, merge, relaying

cdef class _PDLeg:
    cdef public PDRelay ex
    cdef public object conn, role, headers, chunks
    cdef public Py_ssize_t status, size, target
    cdef public bint done
