"""Trace-driven fleet simulator: continuous-batching engines, router, scaling policies.

Modules, one job each: ``ground_truth`` (step-time profile), ``engine`` (one
engine), ``fleet`` (event loop, router, lifecycle), ``traffic`` (traces and
synthetic load), ``policies`` (ours and baselines), ``report`` (metrics, table,
plot), ``publish`` (optional: FPM over real ZMQ sockets).
"""
