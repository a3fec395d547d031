# Declarations of fastroute.dataplane._jsonscan for cimport (dataplane/fields.pxd scans through
# the vtable).
cdef class FieldScan:
    cdef readonly tuple names, keys
    cdef readonly Py_ssize_t messages_at

    cpdef object scan(self, bytes body)
