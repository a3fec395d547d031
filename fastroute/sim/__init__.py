"""Simulated SGLang PD serving for tests, demos and the balance benchmark (no GPU needed).

* ``worker``: simulated prefill/decode servers with DP attention (``python -m fastroute.sim.worker``),
  built from ``engine`` (timing, KV and rendezvous model), ``api`` (request parsing, response
  bodies) and ``server`` (``SimWorker``: one server's HTTP surface).
* ``loadgen``: closed-loop streaming load generator (``python -m fastroute.sim.loadgen``).
* ``balance``: the policy-matrix benchmark (``python bench/balance.py``).
* ``demo``: ``fastroute demo``.
* ``http``: the small httptools server/client they share.
"""
