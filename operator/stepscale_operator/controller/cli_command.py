"""``stepscale operator``: argument definitions and the function that runs it.

Registered in :mod:`stepscale_operator.cli`, which imports this module on use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import re
from typing import Any

log = logging.getLogger(__name__)


def add_operator_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``stepscale operator``."""
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        type=namespace_name,
        help="watch only this namespace (repeatable, a name, not a pattern); "
        "default: all namespaces",
    )
    parser.add_argument(
        "--peering", default="stepscale", help="kopf peering name (default stepscale)"
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority (default: STEPSCALE_PEERING_PRIORITY or random)",
    )
    parser.add_argument(
        "--standalone", action="store_true", help="no peering (a single replica only)"
    )
    parser.add_argument("--metrics-port", type=int, default=9090, help="/metrics port (0: off)")
    parser.add_argument(
        "--health-port", type=int, default=8080, help="/healthz liveness port (0: off)"
    )
    parser.add_argument(
        "--tick-seconds",
        type=float,
        default=1.0,
        help="how often each VllmDeployment is looked at (decisions follow its spec)",
    )
    parser.add_argument(
        "--pod-resync-seconds",
        type=float,
        default=60.0,
        help="how often each VllmDeployment's pods are listed (deletions a watch missed)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def namespace_name(text: str) -> str:
    """A namespace name; patterns are refused: the chart grants a Role per namespace."""
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", text) or len(text) > 63:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a namespace name (patterns are not supported: the operator's "
            "permissions are Roles in the namespaces it watches)"
        )
    return text


def operator_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`~.entry.run_operator` that ``args`` ask for."""
    from stepscale_operator.controller.entry import default_priority
    from stepscale_operator.controller.handlers import ControllerConfig

    config = ControllerConfig(
        tick_s=args.tick_seconds,
        pod_resync_s=args.pod_resync_seconds,
        peering_name=args.peering,
        peering_priority=args.priority if args.priority is not None else default_priority(),
        standalone=args.standalone,
    )
    return {
        "namespaces": list(args.namespace),
        "config": config,
        "metrics_port": args.metrics_port or None,
        "liveness_endpoint": (
            f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
        ),
    }


def run_operator_command(args: argparse.Namespace) -> int:
    """Run the operator until interrupted; returns the exit status.

    Credentials come from the environment, as the ``kubernetes`` client finds them:
    the pod's service account in a cluster, else the kubeconfig (``KUBECONFIG``
    or ``~/.kube/config``); neither is a one-line error and exit status 2.
    """
    from kubernetes.config import ConfigException

    from stepscale_operator.cli_input import InputError
    from stepscale_operator.controller.entry import run_operator

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(run_operator(**operator_options(args)))
    except ConfigException as error:
        # No cluster to talk to is a set-up mistake, not a crash: one line, status 2.
        raise InputError(
            f"no Kubernetes configuration ({error}); expected a kubeconfig (KUBECONFIG or "
            "~/.kube/config) or to run in a pod with a service account"
        ) from None
    return 0
