"""The control plane: the worker registry and its admin API, health checks and load polls,
the HTTP client they use, and the metrics."""
