"""Stepscale operator side: FPM ingest, cost model, load estimation, planner, controller.

The core modules (ingest decoding, cost model, load estimation, planner,
simulator) are plain Python/numpy. Kubernetes (kopf) and ZMQ sockets live only in
the edge modules that say so in their docstrings.
"""

__version__ = "0.1.0"
