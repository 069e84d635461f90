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
from stepscale_operator.controller.kube_api import (
    KubernetesApi,
    api_client_from_environment,
    client_configuration,
)
from stepscale_operator.controller.metrics import OperatorMetrics

log = logging.getLogger(__name__)


def default_priority() -> int:
    """``STEPSCALE_PEERING_PRIORITY`` if set, else a random one (distinct per replica)."""
    text = os.environ.get("STEPSCALE_PEERING_PRIORITY", "").strip()
    if text:
        return int(text)
    return random.SystemRandom().randint(1, 1_000_000)


def login(**_kwargs: Any) -> kopf.ConnectionInfo:
    """Kopf's credentials: the same as the child-object client's
    (:func:`~.kube_api.client_configuration`: the pod's service account in a
    cluster, else the kubeconfig). Kopf calls it again when the server answers 401
    (a rotated token).

    The operator runs on its own registry, which has none of the login handlers
    kopf puts on its default one; without this one kopf finds no credentials.
    """
    configuration = client_configuration()
    # The bearer token (from a token file, a kubeconfig token or an exec plugin):
    # newer clients keep it under "BearerToken", older ones under "authorization".
    header = configuration.get_api_key_with_prefix(
        "BearerToken"
    ) or configuration.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        username=configuration.username or None,
        password=configuration.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
    )


def controller_state_from_environment() -> ControllerState:
    """What the handlers share, with an API client logged in from the environment."""
    return ControllerState(
        kube=KubernetesApi(api_client_from_environment()), metrics=OperatorMetrics()
    )


async def run_operator(
    *,
    namespaces: Sequence[str] = (),
    config: ControllerConfig | None = None,
    metrics_port: int | None = 9090,
    liveness_endpoint: str | None = "http://0.0.0.0:8080/healthz",
    stop_flag: asyncio.Event | None = None,
    ready_flag: asyncio.Event | None = None,
    state: ControllerState | None = None,
    identity: str | None = None,
) -> None:
    """Run the operator until ``stop_flag`` is set (or forever).

    ``namespaces`` empty means cluster-wide. Kopf and the child-object client
    both log in from the environment (in-cluster service account, else the
    kubeconfig). ``state`` (default :func:`controller_state_from_environment`)
    lets a caller (tests) look at the autoscalers while it runs; ``identity``
    names this operator among its peers (default: kopf's, from host and process).
    """
    config = config or ControllerConfig(peering_priority=default_priority())
    if state is None:
        state = controller_state_from_environment()
    if metrics_port is not None:
        start_http_server(metrics_port, registry=state.metrics.registry)
    registry = build_registry(state, config)
    kopf.on.login(registry=registry)(login)
    if namespaces:

        @kopf.on.startup(registry=registry)
        def namespaced_scanning(settings: kopf.OperatorSettings, **_kwargs: Any) -> None:
            # Limited to named namespaces, kopf would list and watch all namespaces and
            # CRDs (cluster-scoped) at start; the chart grants Roles in the watched
            # namespaces only, and 403s there held every handler back for ~55 s.
            settings.scanning.disabled = True

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
