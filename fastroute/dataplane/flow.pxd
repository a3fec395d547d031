# Augmenting declarations for the compiled build of flow.py (Cython pure-Python mode; see
# setup.py): the classes below become extension types, their attributes a C struct. The .py
# stays the source and runs as it is when not compiled; keep both in step.
cdef class FlowControl:
    cdef public object transport, _leg
    cdef public bint reading_paused, writing_paused
