# Declarations of fastroute.dataplane._splice for cimport (route.py frames a leg with framed, body.py
# writes a room with with_int, exchange.py frames a chunk and joins its output, dispatch.py cuts a target's query: C calls).
cpdef bytes framed(bytes head, bytes body, Py_ssize_t end, bytes mid)
cpdef bytes with_int(bytes prefix, long long value)
cpdef bytes post_head(bytes url, bytes host_part, Py_ssize_t length, bytes fwd, bytes auth)
cpdef tuple copied_headers(list headers, bint drop_ctype)
cpdef tuple object_bounds(body)
cpdef bytes chunk(bytes head, bytes data)
cpdef bytes joined(list parts)
cpdef bytes target_path(bytes url)
