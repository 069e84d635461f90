"""Running the operator: ``stepscale operator`` / ``python -m stepscale_operator.controller``.

Two replicas run with kopf peering (``--peering``, default ``stepscale``): only the
one with the highest priority acts, the other waits. Each replica draws a
random priority unless ``--priority`` (or ``STEPSCALE_PEERING_PRIORITY``) sets
one, because kopf freezes every operator of a peering when two have the same
priority. When the active replica dies, the other takes over once its peering
record expires (kopf's peering lifetime, 60 s).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Sequence
from typing import Any

import kopf
from prometheus_client import start_http_server

from stepscale_operator.controller.handlers import (
    ControllerConfig,
    ControllerState,
    build_registry,
)
from stepscale_operator.controller.kube_api import KubernetesApi, api_client_from_environment
from stepscale_operator.controller.metrics import OperatorMetrics

log = logging.getLogger(__name__)


def default_priority() -> int:
    """``STEPSCALE_PEERING_PRIORITY`` if set, else a random one (distinct per replica)."""
    text = os.environ.get("STEPSCALE_PEERING_PRIORITY", "").strip()
    if text:
        return int(text)
    return random.SystemRandom().randint(1, 1_000_000)


async def run_operator(
    *,
    namespaces: Sequence[str] = (),
    config: ControllerConfig | None = None,
    metrics_port: int | None = 9090,
    liveness_endpoint: str | None = "http://0.0.0.0:8080/healthz",
    kube_host: str | None = None,
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    state: ControllerState | None = None,
    identity: str | None = None,
) -> None:
    """Run the operator until ``stop_flag`` is set (or forever).

    ``namespaces`` empty means cluster-wide. ``kube_host`` points both kopf and the
    child-object client at a given API server without credentials (tests);
    otherwise both use the in-cluster service account or the kubeconfig.
    ``state`` lets a caller (tests) look at the autoscalers while it runs;
    ``identity`` names this operator among its peers (default: kopf's, from
    host and process).
    """
    config = config or ControllerConfig(peering_priority=default_priority())
    if state is None:
        state = ControllerState(
            kube=KubernetesApi(api_client_from_environment(kube_host)), metrics=OperatorMetrics()
        )
    if metrics_port is not None:
        start_http_server(metrics_port, registry=state.metrics.registry)
    registry = build_registry(state, config)
    if kube_host is not None:
        server = kube_host

        @kopf.on.login(registry=registry)
        def login(**_: Any) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=server, insecure=True)

    try:
        await kopf.operator(
            registry=registry,
            clusterwide=not namespaces,
            namespaces=list(namespaces),
            standalone=config.standalone,
            peering_name=None if config.standalone else config.peering_name,
            priority=config.peering_priority,
            liveness_endpoint=liveness_endpoint,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
            identity=identity,  # type: ignore[arg-type]  # kopf's Identity is a NewType of str
        )
    finally:
        state.close()
        state.kube.close()
