# Augmenting declarations for the compiled build of fields.py (Cython pure-Python mode; see
# setup.py). The .py stays the source and runs as it is when not compiled; keep both in step.
cdef class FieldPicker:
    cdef public object decoder, keys, names
    cdef public Py_ssize_t messages_at
