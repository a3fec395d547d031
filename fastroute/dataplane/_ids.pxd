# Declarations of fastroute.dataplane._ids for cimport (wire.py's new_request_id calls it in C).
cpdef bytes request_id(bytes prefix)
