# Augmenting declarations for the compiled build of flow.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
from fastroute.dataplane.upstream cimport Leg

cdef class FlowControl:
    cdef public object transport
    cdef object _leg
    cdef readonly bint writing_paused
    cdef bint reading_paused

    # Called by the typed protocol and exchanges: C calls.
    cpdef pause_reading(self)
    cpdef resume_reading(self)
    cpdef pause_writing(self)
    cpdef resume_writing(self)
    cpdef relay(self, Leg leg, bint held=*)
