# Augmenting declarations for the compiled build of fields.py (Cython pure-Python mode; see
# setup.py). The .py stays the source and runs as it is when not compiled; keep both in step.
from fastroute.dataplane._jsonscan cimport FieldScan

cdef class FieldPicker:
    cdef public object decoder, names
    cdef readonly FieldScan scanner

    cpdef pick(self, bytes body)
