# Augmenting declarations for the compiled build of telemetry.py (Cython pure-Python mode; see
# setup.py): the classes become extension types and each event a C method call through the
# object's vtable, so the null object of metrics-off costs a call that returns. The .py stays the
# source and runs as it is when not compiled; keep both in step.

cimport cython

from fastroute.dataplane._clock cimport monotonic
from fastroute.dataplane._hist cimport Hist
from fastroute.dataplane.body cimport RequestMeta

cdef class PathLabels:
    cdef public tuple ok
    cdef public tuple endpoint
    cdef readonly tuple routed, routed_stream
    cdef readonly str model

cdef class Telemetry:
    cpdef double clock(self)
    cpdef request(self, proto, method, path)
    cpdef http_done(self, key, double t0)
    cpdef routed(self, path, RequestMeta meta)
    cpdef overhead(self, proto)
    cpdef pick(self, double t0)
    cpdef response(self, status, code, path=*, model=*, label=*)
    cpdef reply(self, status, code, url, model=*)
    cpdef done(self, Py_ssize_t status, path, RequestMeta meta, double started_at)
    cpdef ttft(self, path, RequestMeta meta, double started_at)
    cpdef worker_error(self, registry, Py_ssize_t target, result)
    cpdef retry(self, role, path)
    cpdef exhausted(self, role, path)
    cpdef connections(self, int delta)
    cpdef rate_limit(self, result)
    cpdef reclaim(self, reason)

cdef class RequestTelemetry(Telemetry):
    cdef public object stats
    cdef readonly object backend
    cdef dict _models
    # The Stats dicts and histograms the events bump (Stats never replaces them): C dict calls
    # and vtable calls, not an attribute lookup and a method call on the Stats object.
    cdef dict _http_requests, _http_responses, _router_requests, _router_errors, _router_duration
    cdef readonly dict _rate_limit
    cdef dict _http_duration, _pd_ttft, _worker_errors, _retries, _retries_exhausted
    cdef Hist _pick_seconds, _overhead_seconds

    @cython.locals(row=dict)
    cpdef PathLabels labels(self, model, path)
    cdef PathLabels _labels_of(self, RequestMeta meta, path)
    cdef _observe(self, Hist h, double v)
    cdef _observe_in(self, dict d, key, double v)

# Label tables built at import, read per event (C globals: dict calls, no module lookup).
cdef dict _PATH_LABEL, _METHOD_LABEL, _STATUS_LABEL, _HTTP_KEY, _HTTP_KEY_OTHER, _HTTP_KEY_WORKER

# Module functions the events call: C calls inside this module (still importable from Python).
cpdef str path_label(path)
@cython.locals(keys=dict)
cpdef tuple http_key(method, path)
