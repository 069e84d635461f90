"""ConnectionMonitor over real ZMQ sockets on 127.0.0.1."""

from __future__ import annotations

import time

import zmq

from stepscale_operator.connection_monitor import ConnectionMonitor
from tests.conftest import free_tcp_port


def test_a_closed_monitor_leaves_the_context_working() -> None:
    """Closing the monitor while its socket lives on must not wedge the context.

    Regression: ``close`` closed the monitor's reader but left the watched socket
    monitored. libzmq sends monitor events from the context's I/O thread with a
    blocking send; the next one (here a reconnect attempt to an endpoint nobody
    listens on, in production a pod that went away) went into a peerless PAIR
    and never returned, so no later socket of that context (the process-wide
    one in the operator) completed a connection. It made the operator tests
    fail depending on which test ran before.
    """
    context = zmq.Context()  # private: a wedged context cannot be terminated, so it leaks
    watched = context.socket(zmq.SUB)
    watched.setsockopt(zmq.LINGER, 0)
    monitor = ConnectionMonitor(watched)
    # Nobody listens there: ZMQ retries every 100 ms, each retry a monitor event.
    watched.connect(f"tcp://127.0.0.1:{free_tcp_port()}")
    time.sleep(0.3)
    monitor.close()
    time.sleep(0.5)  # retries, and their events, after the reader closed

    pub = context.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.subscribe(b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    # Only a working I/O thread completes the handshake that delivers the subscription.
    subscribed = bool(pub.poll(5000))
    assert subscribed, "the context's I/O thread is blocked"
    for sock in (sub, pub, watched):
        sock.close(linger=0)
    context.term()
