"""``stepscale tail`` against real ZMQ publishers on loopback, and its pure TailView.

ZMQ's slow joiner (a SUB misses what a PUB sends before the subscription has
propagated) is designed out rather than waited out: hand-made scenarios are
sent from an XPUB socket, which receives the subscriber's subscription message,
and only then sends; the FpmPublisher test publishes continuously and checks
only what arrived. Every receive is bounded by ``--duration``, so a broken tail
fails its assertions instead of hanging.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgpack
import msgspec
import pytest
import zmq
from msgspec import UNSET, UnsetType

from stepscale_engine import wire
from stepscale_engine.publisher import FpmPublisher
from stepscale_engine.wire import (
    ForwardPassMetrics,
    FrameError,
    QueuedRequestMetrics,
    ScheduledRequestMetrics,
)
from stepscale_operator import cli
from stepscale_operator.tail_view import StreamKey, TailView

SAFETY_DURATION = "30"  # seconds; only reached if the tail under test is broken
STEPSCALE_SCRIPT = Path(sys.executable).parent / "stepscale"


def fpm(
    counter: int,
    worker: str = "w0",
    rank: int = 0,
    wall: float | None = None,
    timing_scope: str | UnsetType = UNSET,
) -> ForwardPassMetrics:
    """A pass (or, with ``wall=0``, a heartbeat) whose values derive from ``counter``."""
    wall_time = 0.001 * (counter + 1) if wall is None else wall
    return ForwardPassMetrics(
        worker_id=worker,
        dp_rank=rank,
        counter_id=counter,
        wall_time=wall_time,
        scheduled_requests=ScheduledRequestMetrics(
            num_decode_requests=counter + 1, sum_decode_kv_tokens=100 * (counter + 1)
        )
        if wall_time
        else ScheduledRequestMetrics(),
        queued_requests=QueuedRequestMetrics(
            num_prefill_requests=counter, var_prefill_length=0.5 * counter
        )
        if wall_time
        else QueuedRequestMetrics(),
        timing_scope=timing_scope,
    )


class ScenarioPublisher:
    """An XPUB on 127.0.0.1 that sends its frames once ``subscribers`` have subscribed."""

    def __init__(
        self, context: zmq.Context, frames: Sequence[Sequence[bytes]], subscribers: int = 1
    ) -> None:
        self.sock = context.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # one message per subscriber
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.port = port
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self._frames = [list(f) for f in frames]
        self._subscribers = subscribers
        self.sent = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> ScenarioPublisher:
        self._thread.start()
        return self

    def _run(self) -> None:
        subscribed = 0
        while subscribed < self._subscribers:
            if not self.sock.poll(20_000):
                return  # nobody came: the test's assertions report it
            if self.sock.recv().startswith(b"\x01"):
                subscribed += 1
        for frames in self._frames:
            self.sock.send_multipart(frames)
        self.sent = True

    def join(self) -> None:
        self._thread.join(timeout=30)
        self.sock.close(linger=0)


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def parse_json_lines(text: str) -> list[ForwardPassMetrics]:
    return [msgspec.json.decode(line, type=ForwardPassMetrics) for line in text.splitlines()]


# The main scenario: a stream with a gap, malformed frames, a restart and a
# heartbeat, plus a second stream on the same endpoint.
VALID_IN_ORDER = [
    fpm(0),
    fpm(1, timing_scope=wire.TIMING_SCOPE_MODEL_STEP_HOST),
    fpm(2),
    fpm(0, worker="w1", rank=3),
    fpm(5),  # counters 3 and 4 lost: a gap of 2
    fpm(6),
    fpm(1),  # went back: a restart
    fpm(2, wall=0.0),  # heartbeat
]
MALFORMED = [
    [b"", wire.encode_sequence(3)],  # two frames
    [b"", b"\x00" * 7, wire.encode_payload(fpm(3))],  # 7-byte sequence
    [b"", wire.encode_sequence(3), b"\xc1\xc1\xc1"],  # not msgpack
    [b"", wire.encode_sequence(3), msgpack.packb({"version": 2, "counter_id": 3})],
    # An unknown key holding a value nested 1000 deep: too deep for any decoder's stack.
    [b"", wire.encode_sequence(3), b"\x81\xa5other" + b"\x91" * 1000 + b"\xc0"],
]
EXPECTED_REASONS = {
    FrameError.FRAME_COUNT: 1,
    FrameError.SEQUENCE_LENGTH: 1,
    FrameError.NOT_MSGPACK: 1,
    FrameError.VERSION: 1,
    FrameError.SCHEMA: 1,
}


def scenario_frames() -> list[list[bytes]]:
    frames = [wire.encode_frames(m) for m in VALID_IN_ORDER]
    # Malformed frames in the middle, so the tail meets them before its last message.
    return frames[:4] + MALFORMED + frames[4:]


def test_json_lines_match_sent_messages_and_malformed_frames_are_counted(
    context: zmq.Context, capsys: pytest.CaptureFixture[str]
) -> None:
    pub = ScenarioPublisher(context, scenario_frames()).start()
    status = cli.main(
        [
            "tail",
            pub.endpoint,
            "--json",
            "--count",
            str(len(VALID_IN_ORDER)),
            "--duration",
            SAFETY_DURATION,
        ]
    )
    pub.join()
    out, err = capsys.readouterr()

    assert status == 0
    assert parse_json_lines(out) == VALID_IN_ORDER
    assert '"timing_scope":"model_step_host"' in out.splitlines()[1]
    assert "timing_scope" not in out.splitlines()[0]  # UNSET is omitted, as on the wire
    summary = err.strip().splitlines()[-1]
    assert "8 messages from 2 streams, gaps=2 restarts=1 malformed=5" in summary
    for reason in EXPECTED_REASONS:
        assert f"{reason.value}=1" in summary
        assert f"malformed frame from {pub.endpoint}: {reason.value}" in err


def test_table_shows_per_stream_counters_and_malformed_reasons(
    context: zmq.Context, capsys: pytest.CaptureFixture[str]
) -> None:
    pub = ScenarioPublisher(context, scenario_frames()).start()
    # Interval far beyond the run: the only table is the final one.
    status = cli.main(
        [
            "tail",
            str(pub.port),
            "--table",
            "--interval",
            "3600",
            "--count",
            str(len(VALID_IN_ORDER)),
            "--duration",
            SAFETY_DURATION,
        ]
    )
    pub.join()
    out, _err = capsys.readouterr()

    assert status == 0
    assert "\x1b[" not in out  # not a terminal: plain text blocks
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("w")}
    header = next(line.split() for line in out.splitlines() if line.startswith("WORKER"))
    w0 = dict(zip(header, rows["w0"], strict=True))
    assert w0["DP"] == "0"
    assert w0["PASSES"] == "6"
    assert w0["HEARTBEATS"] == "1"
    assert w0["GAPS"] == "2"
    assert w0["RESTARTS"] == "1"
    assert w0["LAST_MS"] == "2.00"  # fpm(1) after the restart; heartbeats do not count
    passes_ms = [1.0, 2.0, 3.0, 6.0, 7.0, 2.0]
    assert w0["MEAN_MS"] == f"{sum(passes_ms) / len(passes_ms):.2f}"
    w1 = dict(zip(header, rows["w1"], strict=True))
    assert (w1["DP"], w1["PASSES"], w1["GAPS"], w1["RESTARTS"]) == ("3", "1", "0", "0")
    malformed_line = next(line for line in out.splitlines() if line.startswith("malformed"))
    assert malformed_line == (
        f"malformed from {pub.endpoint}: frame_count=1 not_msgpack=1 schema=1"
        " sequence_length=1 version=1"
    )


def test_sequence_differing_from_counter_is_shown_not_rejected(
    context: zmq.Context, capsys: pytest.CaptureFixture[str]
) -> None:
    # The spec rejects only wrong frame counts and sequence lengths.
    messages = [fpm(0), fpm(1)]
    frames = [[b"", wire.encode_sequence(99), wire.encode_payload(messages[0])],
              wire.encode_frames(messages[1])]
    pub = ScenarioPublisher(context, frames).start()
    status = cli.main(
        ["tail", pub.endpoint, "--json", "--count", "2", "--duration", SAFETY_DURATION]
    )
    pub.join()
    out, err = capsys.readouterr()
    assert status == 0
    assert parse_json_lines(out) == messages
    assert "malformed=0" in err.strip().splitlines()[-1]


def test_several_endpoints_are_merged(
    context: zmq.Context, capsys: pytest.CaptureFixture[str]
) -> None:
    first = ScenarioPublisher(context, [wire.encode_frames(fpm(i, "a", 0)) for i in range(3)])
    second = ScenarioPublisher(context, [wire.encode_frames(fpm(i, "b", 1)) for i in range(2)])
    first.start()
    second.start()
    status = cli.main(
        [
            "tail",
            first.endpoint,
            f"127.0.0.1:{second.port}",
            "--json",
            "--count",
            "5",
            "--duration",
            SAFETY_DURATION,
        ]
    )
    first.join()
    second.join()
    received = parse_json_lines(capsys.readouterr().out)

    assert status == 0
    assert [m for m in received if m.worker_id == "a"] == [fpm(i, "a", 0) for i in range(3)]
    assert [m for m in received if m.worker_id == "b"] == [fpm(i, "b", 1) for i in range(2)]


def test_tail_of_a_live_fpm_publisher(tcp_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    endpoint = f"tcp://127.0.0.1:{tcp_port}"
    stop = threading.Event()

    def publish_until_stopped(publisher: FpmPublisher) -> None:
        # Keeps sending, so the subscriber gets messages whenever it joins.
        index = 0
        while not stop.wait(0.005):
            publisher.publish(
                0.001 * (index + 1),
                ScheduledRequestMetrics(num_decode_requests=index),
                QueuedRequestMetrics(num_prefill_requests=2 * index),
                wire.TIMING_SCOPE_MODEL_STEP_HOST,
            )
            index += 1

    with FpmPublisher(endpoint, "pod-live", dp_rank=2) as publisher:
        sender = threading.Thread(target=publish_until_stopped, args=(publisher,), daemon=True)
        sender.start()
        try:
            status = cli.main(
                ["tail", endpoint, "--json", "--count", "5", "--duration", SAFETY_DURATION]
            )
        finally:
            stop.set()
            sender.join(timeout=10)
    received = parse_json_lines(capsys.readouterr().out)

    assert status == 0
    assert len(received) == 5
    passes = [m for m in received if not m.is_heartbeat]
    assert passes
    for msg in received:
        assert (msg.worker_id, msg.dp_rank) == ("pod-live", 2)
    for msg in passes:
        index = msg.scheduled_requests.num_decode_requests
        assert msg.wall_time == pytest.approx(0.001 * (index + 1))
        assert msg.queued_requests.num_prefill_requests == 2 * index
        assert msg.timing_scope == wire.TIMING_SCOPE_MODEL_STEP_HOST
    counters = [m.counter_id for m in received]
    assert counters == list(range(counters[0], counters[0] + 5))


def test_console_script_prints_json_lines(context: zmq.Context) -> None:
    assert STEPSCALE_SCRIPT.exists(), "the package is installed with its console script"
    messages = [fpm(i, "sub", 1) for i in range(3)]
    pub = ScenarioPublisher(context, [wire.encode_frames(m) for m in messages]).start()
    proc = subprocess.run(
        [
            str(STEPSCALE_SCRIPT),
            "tail",
            str(pub.port),
            "--json",
            "--count",
            "3",
            "--duration",
            SAFETY_DURATION,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    pub.join()

    assert proc.returncode == 0, proc.stderr
    assert parse_json_lines(proc.stdout) == messages
    assert "3 messages from 1 streams" in proc.stderr


def test_ctrl_c_exits_with_status_zero(context: zmq.Context) -> None:
    pub = ScenarioPublisher(context, [wire.encode_frames(fpm(0, "sig"))]).start()
    proc = subprocess.Popen(
        [str(STEPSCALE_SCRIPT), "tail", pub.endpoint, "--json", "--duration", SAFETY_DURATION],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        first_line = proc.stdout.readline()  # the tail is running and subscribed
        proc.send_signal(signal.SIGINT)
        _rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.join()

    assert parse_json_lines(first_line) == [fpm(0, "sig")]
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert "1 messages from 1 streams" in err


# -- arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "endpoint"),
    [
        ("20380", "tcp://127.0.0.1:20380"),
        ("engine-0.svc:20381", "tcp://engine-0.svc:20381"),
        ("*:20380", "tcp://127.0.0.1:20380"),
        ("tcp://10.0.0.7:5555", "tcp://10.0.0.7:5555"),
        ("ipc:///tmp/fpm.0", "ipc:///tmp/fpm.0"),
        ("[::1]:7000", "tcp://[::1]:7000"),
    ],
)
def test_endpoint_forms(text: str, endpoint: str) -> None:
    assert cli.parse_endpoint(text) == endpoint


@pytest.mark.parametrize("text", ["", "host", "host:port", "70000", "host:0"])
def test_bad_endpoints_are_rejected(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        cli.parse_endpoint(text)


@pytest.mark.parametrize(
    "argv",
    [
        ["tail"],
        ["tail", "20380", "--json", "--table"],
        ["tail", "20380", "--interval", "0"],
        ["tail", "20380", "--count", "0"],
        ["tail", "not an endpoint"],
    ],
)
def test_bad_arguments_exit_with_usage_error(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2


def test_parser_is_built_from_the_registry() -> None:
    assert "tail" in cli.SUBCOMMANDS
    args = cli.build_parser().parse_args(["tail", "7000"])
    assert args.run is cli.run_tail
    assert (args.endpoints, args.mode, args.interval) == (["tcp://127.0.0.1:7000"], "table", 1.0)
    with pytest.raises(ValueError, match="already registered"):
        cli.register(cli.SUBCOMMANDS["tail"])


def test_no_subcommand_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "tail" in capsys.readouterr().err


# -- TailView ----------------------------------------------------------------------


def test_view_counts_gaps_restarts_duplicates_and_heartbeats() -> None:
    view = TailView()
    for now, msg in enumerate([fpm(0), fpm(1), fpm(4), fpm(4), fpm(5, wall=0.0), fpm(0)]):
        view.record(msg, float(now))
    stats = view.streams[StreamKey("w0", 0)]
    assert (stats.messages, stats.passes, stats.heartbeats) == (6, 5, 1)
    assert (stats.gaps, stats.restarts, stats.duplicates) == (2, 1, 1)
    assert stats.last_counter == 0
    assert stats.last_wall_time_s == pytest.approx(0.001)
    assert stats.mean_wall_time_s == pytest.approx((0.001 + 0.002 + 0.005 + 0.005 + 0.001) / 5)
    assert view.total_messages == 6


def test_view_keys_streams_by_worker_and_rank() -> None:
    view = TailView()
    view.record(fpm(0, "b", 0), 0.0)
    view.record(fpm(0, "a", 1), 0.0)
    view.record(fpm(0, "a", 0), 0.0)
    view.record(fpm(1, "a", 1), 0.0)
    assert [row.key for row in view.rows(1.0)] == [
        StreamKey("a", 0),
        StreamKey("a", 1),
        StreamKey("b", 0),
    ]
    assert all(stats.gaps == 0 and stats.restarts == 0 for stats in view.streams.values())


def test_view_rate_and_age() -> None:
    view = TailView(rate_window_s=5.0)
    for i in range(10):
        view.record(fpm(i), 0.1 * i)
    (row,) = view.rows(1.0)
    assert row.rate_per_s == pytest.approx(10.0)  # 10 messages, span floored at 1 s
    assert row.age_s == pytest.approx(0.1)
    for second in range(1, 10):  # one a second from t=1 to t=9
        view.record(fpm(9 + second), float(second))
    (row,) = view.rows(10.0)
    assert row.rate_per_s == pytest.approx(1.0)  # only t=5..9 are in the 5 s window
    (row,) = view.rows(100.0)
    assert row.rate_per_s == 0.0
    assert row.age_s == pytest.approx(91.0)


def test_view_first_message_has_no_gap_whatever_its_sequence() -> None:
    view = TailView()
    view.record(fpm(57), 0.0)  # joined a running stream
    assert view.streams[StreamKey("w0", 0)].gaps == 0


def test_view_counts_malformed_per_endpoint_and_reason() -> None:
    view = TailView()
    view.record_malformed("tcp://a:1", FrameError.SCHEMA)
    view.record_malformed("tcp://a:1", FrameError.SCHEMA)
    view.record_malformed("tcp://b:2", FrameError.VERSION)
    assert view.malformed["tcp://a:1"][FrameError.SCHEMA] == 2
    assert view.malformed_by_reason() == {FrameError.SCHEMA: 2, FrameError.VERSION: 1}
    assert view.total_messages == 0
    text = view.render(0.0)
    assert "(no messages yet)" in text
    assert "malformed from tcp://a:1: schema=2" in text
    assert "malformed from tcp://b:2: version=1" in text


def test_view_render_is_an_aligned_table() -> None:
    view = TailView()
    view.record(fpm(0, "long-worker-name", 12, wall=0.0123), 0.0)
    view.record(fpm(0, "w", 0), 0.0)
    lines = view.render(2.0).splitlines()
    assert lines[0].split() == [
        "WORKER",
        "DP",
        "MSG/S",
        "PASSES",
        "LAST_MS",
        "MEAN_MS",
        "GAPS",
        "RESTARTS",
        "DUPS",
        "HEARTBEATS",
        "AGE_S",
    ]
    assert lines[1].split() == [
        "long-worker-name",
        "12",
        "0.5",
        "1",
        "12.30",
        "12.30",
        "0",
        "0",
        "0",
        "0",
        "2.0",
    ]
    assert lines[2].split()[:6] == ["w", "0", "0.5", "1", "1.00", "1.00"]
    # Right-aligned numbers: every row ends at the same column.
    assert len({len(line) for line in lines}) == 1


def test_view_heartbeat_only_stream_has_no_wall_time() -> None:
    view = TailView()
    view.record(fpm(0, wall=0.0), 0.0)
    (row,) = view.rows(0.0)
    assert (row.passes, row.heartbeats, row.last_wall_time_ms, row.mean_wall_time_ms) == (
        0,
        1,
        None,
        None,
    )
    assert " - " in view.render(0.0).splitlines()[1]


def test_view_rejects_a_non_positive_window() -> None:
    with pytest.raises(ValueError):
        TailView(rate_window_s=0)
