# Augmenting declarations for the compiled build of telemetry.py (Cython pure-Python mode; see
# setup.py): the classes become extension types and each event a C method call through the
# object's vtable, so the null object of metrics-off costs a call that returns. The .py stays the
# source and runs as it is when not compiled; keep both in step.

from fastroute.dataplane._hist cimport Hist

cdef class PathLabels:
    cdef public tuple routed, routed_stream, endpoint
    cdef public str model

cdef class Telemetry:
    cpdef double clock(self)
    cpdef request(self, proto, method, path)
    cpdef http_done(self, key, double t0)
    cpdef routed(self, path, meta)
    cpdef overhead(self, proto)
    cpdef pick(self, double t0)
    cpdef response(self, status, code, path=*, model=*, label=*)
    cpdef reply(self, status, code, url, model=*)
    cpdef duration(self, path, model, double started_at)
    cpdef ttft(self, path, model, double started_at)
    cpdef worker_error(self, registry, Py_ssize_t target, result)
    cpdef retry(self, role, path)
    cpdef exhausted(self, role, path)
    cpdef connections(self, int delta)
    cpdef rate_limit(self, result)
    cpdef reclaim(self, reason)

cdef class RequestTelemetry(Telemetry):
    cdef public object stats, loop, backend
    cdef dict _models

    cpdef PathLabels labels(self, model, path)
    cdef _observe(self, Hist h, double v)
    cdef _observe_in(self, dict d, key, double v)

# Module functions the events call: C calls inside this module (still importable from Python).
cpdef str path_label(path)
cpdef tuple http_key(method, path)
