"""Subscribe to one FPM endpoint and write every message as a JSON line, in a process of its own.

A recorder that subscribes from the engine's own process shares its interpreter
lock: where the engine's passes wait on Python (eager kernel launches), decoding
and writing each message would show in the step times it records. This process
does that work instead.

    python benchmarks/fpm_sink.py ENDPOINT OUT.jsonl.gz

Prints ``live`` once the first heartbeat arrives (ZMQ drops what is published
before a subscriber joins, so the caller starts the engine after that). Stops when
its standard input reads ``stop N`` and N passes have arrived (the publisher sends
in batches, so the last ones may still be on their way), or ``QUIET_S`` after
that with nothing more, or when its input closes; then prints one JSON line:
``messages`` (passes), ``heartbeats``, ``malformed``.
"""

from __future__ import annotations

import gzip
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "engine_plugin"))

QUIET_S = 5.0  # after ``stop N``: give up on the missing passes after this long without any


def sink(endpoint: str, path: Path) -> dict[str, int]:
    """Write every message from ``endpoint`` to ``path`` until told to stop; the counts."""
    import msgspec
    import zmq

    from stepscale_engine import wire

    counts = {"messages": 0, "heartbeats": 0, "malformed": 0}
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    expected: int | None = None  # passes to wait for, once told to stop
    quiet_since = time.monotonic()
    with gzip.open(path, "wb") as fh:
        while expected is None or counts["messages"] < expected:
            ready = dict(poller.poll(50))
            if sys.stdin.fileno() in ready and expected is None:
                words = sys.stdin.readline().split()
                expected = int(words[1]) if len(words) == 2 and words[0] == "stop" else 0
            if sock not in ready:
                if expected is not None and time.monotonic() - quiet_since > QUIET_S:
                    break
                continue
            quiet_since = time.monotonic()
            try:
                msg = wire.decode_frames(sock.recv_multipart())
            except wire.DecodeError:
                counts["malformed"] += 1
                continue
            fh.write(msgspec.json.encode(msg) + b"\n")
            if msg.is_heartbeat:
                counts["heartbeats"] += 1
                if counts["heartbeats"] == 1:
                    print("live", flush=True)
            else:
                counts["messages"] += 1
    sock.close(linger=0)
    return counts


def main() -> int:
    endpoint, out = sys.argv[1], Path(sys.argv[2])
    print(json.dumps(sink(endpoint, out)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
