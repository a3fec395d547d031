"""The data plane: the client HTTP protocol, request bodies, admission, exchanges (regular and
PD), the upstream connection pool and its framing. Never imports NumPy or a compiled module:
the routing groups and breakers it uses are handed to it by the runtime."""
