"""The runtime: assembly of one router process, the single-process server, and the supervisor
of ``--workers N`` proxy processes."""
