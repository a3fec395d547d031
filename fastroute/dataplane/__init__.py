"""The data plane: the client HTTP protocol, what each path means (endpoints), request bodies,
admission, exchanges (regular and PD), the upstreams (routes per target, pools, breaker outcomes)
and their framing. Never imports NumPy or the core's modules: the routing groups, breakers and
reconciler it uses are handed to it by the runtime. Its hot classes are compiled from their .py
through the .pxd beside each (Cython's pure-Python mode), with five small .pyx helpers; every .py
also runs as it is (CI tests the interpreted data plane too)."""
