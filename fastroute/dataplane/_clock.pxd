# Declarations of fastroute.dataplane._clock for cimport (telemetry and the pools read it in C).
cpdef double monotonic() noexcept
