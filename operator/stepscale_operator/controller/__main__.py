"""``python -m stepscale_operator.controller``: the same as ``stepscale operator``."""

from __future__ import annotations

import argparse
import sys

from stepscale_operator.controller.cli_command import add_operator_arguments, run_operator_command


def main() -> int:
    """Parse the arguments and run the operator."""
    parser = argparse.ArgumentParser(
        prog="python -m stepscale_operator.controller",
        description="Run the Stepscale VllmDeployment operator.",
    )
    add_operator_arguments(parser)
    return run_operator_command(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
