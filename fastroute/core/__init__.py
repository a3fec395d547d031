"""The compiled core: the shared target table, the atomics, the policy kernels, the ledger
(leases and pickers), the prefix tree, routing groups, circuit-breaker cells and the NumPy
reference twins. The only package of fastroute that imports NumPy or Cython modules."""
