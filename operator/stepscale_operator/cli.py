"""The ``stepscale`` command line.

Subcommands live in :data:`SUBCOMMANDS`; each is a :class:`Subcommand` naming
how it adds its arguments and the function that runs it. To add one, write its
two functions and :func:`register` it at the bottom of this module; a subcommand
with heavy dependencies lives in its own module, named through :func:`_on_use`,
so that ``stepscale tail`` does not pay for them at start-up.

``stepscale tail`` is this module's own subcommand: it subscribes to one or more
FPM publishers and prints every message as a JSON line, or a live per-stream
table, like ``kubectl get -w``. Only messages (or the table) go to stdout;
diagnostics go to stderr. Malformed frames are counted per endpoint and reason,
never fatal. Ctrl-C ends it with status 0.
"""

from __future__ import annotations

import argparse
import importlib
import ipaddress
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import msgspec
import zmq

from stepscale_engine.wire import DecodeError, ForwardPassMetrics, FrameError, decode_frames
from stepscale_operator.cli_input import (
    InputError,
    OneLineParser,
    positive_float,
    positive_int,
    report,
)
from stepscale_operator.tail_view import TailView

# ANSI: cursor home, clear to end of screen. Only used when stdout is a terminal.
_REDRAW = "\x1b[H\x1b[J"
# Frames handled per socket before the loop looks at the clock again, so a
# flooding publisher cannot starve the table refresh or the deadline.
_MAX_FRAMES_PER_POLL = 1000


@dataclass(frozen=True)
class Subcommand:
    """One ``stepscale`` subcommand."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}
"""The registry :func:`build_parser` builds its subparsers from, in order."""


def register(subcommand: Subcommand) -> Subcommand:
    """Add ``subcommand`` to :data:`SUBCOMMANDS`; names must be unique."""
    if subcommand.name in SUBCOMMANDS:
        raise ValueError(f"subcommand {subcommand.name!r} is already registered")
    SUBCOMMANDS[subcommand.name] = subcommand
    return subcommand


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per registered subcommand."""
    parser = OneLineParser(
        prog="stepscale",
        description="Stepscale: autoscaling vLLM on Kubernetes from per-forward-pass metrics.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for subcommand in SUBCOMMANDS.values():
        sub = subparsers.add_parser(
            subcommand.name, help=subcommand.help, description=subcommand.help
        )
        subcommand.add_arguments(sub)
        sub.set_defaults(run=subcommand.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stepscale`` console script; returns the exit status.

    A bad input (:class:`~stepscale_operator.cli_input.InputError`) is one line on
    stderr and exit status 2, whichever subcommand finds it.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "run", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        status: int = args.run(args)
    except InputError as error:
        return report(f"stepscale {args.command}", error)
    return status


# -- tail ----------------------------------------------------------------------


def parse_endpoint(text: str) -> str:
    """A ZMQ endpoint to connect to, from ``tcp://host:port``, ``ipc://path``,
    ``host:port`` or a bare port (meaning 127.0.0.1)."""
    text = text.strip()
    if text.startswith(("tcp://", "ipc://", "inproc://")):
        return text
    if text.isdigit():
        host, port = "127.0.0.1", text
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not port.isdigit():
            raise argparse.ArgumentTypeError(
                f"{text!r} is not tcp://HOST:PORT, ipc://PATH, HOST:PORT or PORT"
            )
        # A publisher's bind address ("*:20380") names no host to connect to.
        if host in ("", "*"):
            host = "127.0.0.1"
    if not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"port {port} is out of range")
    return f"tcp://{host}:{int(port)}"


def resolve_endpoint(endpoint: str) -> None:
    """Raise :class:`InputError` if a ``tcp://`` endpoint's host has no address.

    ZMQ would retry a name that does not resolve forever, silently; a typo
    should fail at once instead.
    """
    if not endpoint.startswith("tcp://"):
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise InputError(
            f"ENDPOINT {endpoint}: cannot resolve host {host!r} ({error}); "
            "expected a resolvable host name or an IP address"
        ) from None


def add_tail_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``stepscale tail``."""
    parser.add_argument(
        "endpoints",
        metavar="ENDPOINT",
        nargs="+",
        type=parse_endpoint,
        help="publisher to subscribe to: tcp://HOST:PORT, ipc://PATH, HOST:PORT, or PORT",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--json",
        dest="mode",
        action="store_const",
        const="json",
        help="print each message as one JSON line",
    )
    mode.add_argument(
        "--table",
        dest="mode",
        action="store_const",
        const="table",
        help="print a per-stream table every --interval seconds (the default)",
    )
    parser.set_defaults(mode="table")
    parser.add_argument(
        "--interval",
        type=positive_float,
        default=1.0,
        help="table refresh interval in seconds (default 1.0)",
    )
    parser.add_argument(
        "--count",
        type=positive_int,
        default=None,
        help="exit after this many messages (heartbeats included)",
    )
    parser.add_argument(
        "--duration",
        type=positive_float,
        default=None,
        help="exit after this many seconds",
    )


class _TailOutput:
    """Writes what ``tail`` shows: JSON lines, or table frames."""

    def __init__(self, mode: str, stdout: TextIO, stderr: TextIO) -> None:
        self.mode = mode
        self._stdout = stdout
        self._stderr = stderr
        self._is_tty = stdout.isatty()
        self._encoder = msgspec.json.Encoder()
        self._reported: set[tuple[str, FrameError]] = set()
        self._rendered_updates = -1

    def message(self, msg: ForwardPassMetrics) -> None:
        if self.mode == "json":
            self._stdout.write(self._encoder.encode(msg).decode() + "\n")
            # One line per message must reach a pipe as it happens.
            self._stdout.flush()

    def malformed(self, endpoint: str, error: DecodeError) -> None:
        # Hostile input can arrive thousands of times a second: say each
        # (endpoint, reason) once; the counts come in the table and the summary.
        if (endpoint, error.reason) not in self._reported:
            self._reported.add((endpoint, error.reason))
            self._stderr.write(f"stepscale tail: malformed frame from {endpoint}: {error}\n")

    def table(self, view: TailView, now: float, *, only_if_changed: bool = False) -> None:
        if self.mode != "table" or (only_if_changed and view.updates == self._rendered_updates):
            return
        self._rendered_updates = view.updates
        block = view.render(now)
        if self._is_tty:
            self._stdout.write(_REDRAW + block)
        else:
            self._stdout.write(time.strftime("%H:%M:%S") + "\n" + block + "\n")
        self._stdout.flush()

    def summary(self, view: TailView) -> None:
        gaps = sum(s.gaps for s in view.streams.values())
        restarts = sum(s.restarts for s in view.streams.values())
        malformed = view.malformed_by_reason()
        detail = " ".join(f"{r.value}={n}" for r, n in sorted(malformed.items(), key=_by_value))
        self._stderr.write(
            f"stepscale tail: {view.total_messages} messages from {len(view.streams)} streams,"
            f" gaps={gaps} restarts={restarts} malformed={sum(malformed.values())}"
            + (f" ({detail})" if detail else "")
            + "\n"
        )


def _by_value(item: tuple[FrameError, int]) -> str:
    return item[0].value


def run_tail(args: argparse.Namespace) -> int:
    """Run ``stepscale tail`` until --count, --duration or Ctrl-C; returns 0."""
    for endpoint in args.endpoints:
        resolve_endpoint(endpoint)
    output = _TailOutput(args.mode, sys.stdout, sys.stderr)
    view = TailView()
    # A private context, so that closing it cannot disturb anyone else's sockets
    # when tail runs inside a larger process (tests, notebooks).
    context = zmq.Context()
    sockets: dict[zmq.Socket, str] = {}
    poller = zmq.Poller()
    try:
        for endpoint in args.endpoints:
            sock = context.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
            sockets[sock] = endpoint
            poller.register(sock, zmq.POLLIN)
        sys.stderr.write(f"stepscale tail: subscribed to {', '.join(args.endpoints)}\n")
        _tail_loop(args, sockets, poller, view, output)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a user ends a tail: not an error
    except BrokenPipeError:
        # Reader went away (`stepscale tail ... | head`): stop quietly, and point
        # stdout at /dev/null so the interpreter's final flush does not complain.
        _silence_stdout()
    finally:
        for sock in sockets:
            sock.close(linger=0)
        context.term()
    if args.mode == "table":
        try:
            # The final state, unless the last refresh already showed it.
            output.table(view, time.monotonic(), only_if_changed=True)
        except BrokenPipeError:
            _silence_stdout()
    output.summary(view)
    return 0


def _tail_loop(
    args: argparse.Namespace,
    sockets: dict[zmq.Socket, str],
    poller: zmq.Poller,
    view: TailView,
    output: _TailOutput,
) -> None:
    start = time.monotonic()
    deadline = None if args.duration is None else start + args.duration
    next_render = start + args.interval
    while True:
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            return
        wake_at = next_render if args.mode == "table" else now + 1.0
        if deadline is not None:
            wake_at = min(wake_at, deadline)
        timeout_ms = max(0, int((wake_at - now) * 1000) + 1)
        for sock, _event in poller.poll(timeout_ms):
            endpoint = sockets[sock]
            for _ in range(_MAX_FRAMES_PER_POLL):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = decode_frames(frames)
                except DecodeError as error:
                    view.record_malformed(endpoint, error.reason)
                    output.malformed(endpoint, error)
                    continue
                view.record(msg, time.monotonic())
                output.message(msg)
                if args.count is not None and view.total_messages >= args.count:
                    return
        now = time.monotonic()
        if args.mode == "table" and now >= next_render:
            output.table(view, now)
            # Skip missed refreshes rather than printing a burst of them.
            while next_render <= now:
                next_render += args.interval


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass  # stdout is not a real file (captured in tests): nothing to silence


register(
    Subcommand(
        name="tail",
        help="print the FPM messages of one or more publishers, as JSON lines or a live table",
        add_arguments=add_tail_arguments,
        run=run_tail,
    )
)


def _on_use(module: str, function: str) -> Callable[[Any], Any]:
    """``module.function``, imported at its first call: the demo, the operator and
    the simulator pull in numpy, vLLM, kopf and kubernetes, which ``tail`` needs none of."""

    def call(arg: Any) -> Any:
        return getattr(importlib.import_module(module), function)(arg)

    return call


register(
    Subcommand(
        name="demo",
        help="run the whole loop locally for a few minutes: a real vLLM CPU engine pushed past "
        "its SLO and back, the recommendation with its reasons, a summary at the end",
        add_arguments=_on_use("stepscale_operator.demo", "add_demo_arguments"),
        run=_on_use("stepscale_operator.demo", "run_demo"),
    )
)
register(
    Subcommand(
        name="operator",
        help="run the VllmDeployment operator (kopf) against the current cluster",
        add_arguments=_on_use(
            "stepscale_operator.controller.cli_command", "add_operator_arguments"
        ),
        run=_on_use("stepscale_operator.controller.cli_command", "run_operator_command"),
    )
)
register(
    Subcommand(
        name="simulate",
        help="simulate a fleet of engines under a trace and compare scaling policies",
        add_arguments=_on_use("stepscale_operator.simulate_cli", "add_simulate_arguments"),
        run=_on_use("stepscale_operator.simulate_cli", "run_simulate"),
    )
)


if __name__ == "__main__":
    sys.exit(main())
