"""``stepscale operator``: argument definitions and the function that runs it.

Registered in :mod:`stepscale_operator.cli`, which imports this module on use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging


def add_operator_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``stepscale operator``."""
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default: all namespaces",
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
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")


def run_operator_command(args: argparse.Namespace) -> int:
    """Run the operator until interrupted; returns the exit status."""
    from stepscale_operator.controller.entry import default_priority, run_operator
    from stepscale_operator.controller.handlers import ControllerConfig

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = ControllerConfig(
        tick_s=args.tick_seconds,
        peering_name=args.peering,
        peering_priority=args.priority if args.priority is not None else default_priority(),
        standalone=args.standalone,
    )
    from kubernetes.config import ConfigException

    from stepscale_operator.cli_input import InputError

    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(
                run_operator(
                    namespaces=args.namespace,
                    config=config,
                    metrics_port=args.metrics_port or None,
                    liveness_endpoint=(
                        f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
                    ),
                )
            )
    except ConfigException as error:
        # No cluster to talk to is a set-up mistake, not a crash: one line, status 2.
        raise InputError(
            f"no Kubernetes configuration ({error}); expected a kubeconfig (KUBECONFIG or "
            "~/.kube/config) or to run in a pod with a service account"
        ) from None
    return 0
