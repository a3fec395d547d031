# Declarations of fastroute.dataplane._jsonscan for cimport (dataplane/fields.pxd scans through
# the vtable; dataplane/body.pxd reads a Chat's count and tokens as C fields).

cdef struct _Part:
    Py_ssize_t start  # offset of the string's first byte in the body
    Py_ssize_t raw
    Py_ssize_t chars
    int flags

cdef class Chat:
    cdef readonly Py_ssize_t count
    cdef readonly Py_ssize_t tokens
    cdef bytes body
    cdef _Part *parts
    cdef Py_ssize_t nparts, cap

    cdef int add(self, Py_ssize_t start, Py_ssize_t raw, Py_ssize_t chars, int flags) except -1

cdef class Ids:
    cdef readonly Py_ssize_t count
    cdef bytes body
    cdef Py_ssize_t start, stop  # the array's bytes in the body, brackets included

cdef class FieldScan:
    cdef readonly tuple names, keys
    cdef readonly Py_ssize_t messages_at, ids_at

    cpdef object scan(self, bytes body)
