"""Re-connects FPM endpoints whose connection ZMQ dropped and will not restore itself.

ZMQ reconnects a connection that failed (a pod restarting, a network error) on
its own, but not one it closed for a protocol error, such as a frame over the
socket's ``ZMQ_MAXMSGSIZE``: that endpoint would stay silent for good and its
pod's stream would count as missing until the pod changed. This watches the
socket's monitor events: a disconnect that ZMQ does not follow with its own
reconnect attempt within ``delay_s`` is re-connected here, and counted.
"""

from __future__ import annotations

import contextlib

import zmq
from zmq.utils.monitor import parse_monitor_message

_EVENTS = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_DELAYED
    | zmq.EVENT_CONNECT_RETRIED
)
_RETRYING = (zmq.EVENT_CONNECTED, zmq.EVENT_CONNECT_DELAYED, zmq.EVENT_CONNECT_RETRIED)


class ConnectionMonitor:
    """Endpoints of one socket to re-connect (use from the thread that owns the socket)."""

    def __init__(self, sock: zmq.Socket, delay_s: float = 1.0) -> None:
        self.delay_s = float(delay_s)
        self._watched = sock
        self.socket: zmq.Socket = sock.get_monitor_socket(_EVENTS)
        self._due: dict[str, float] = {}  # endpoint -> when to re-connect it

    def read_events(self, now: float) -> None:
        """Take the pending monitor events: a disconnect is due for a re-connect at
        ``now + delay_s`` unless ZMQ starts reconnecting it first."""
        while self.socket.poll(0):
            event = parse_monitor_message(self.socket.recv_multipart())
            endpoint = event["endpoint"].decode(errors="replace")
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._due[endpoint] = now + self.delay_s
            elif event["event"] in _RETRYING:
                self._due.pop(endpoint, None)

    def due(self, now: float) -> list[str]:
        """Endpoints whose re-connect is due (each returned once)."""
        ready = [ep for ep, at in self._due.items() if at <= now]
        for ep in ready:
            del self._due[ep]
        return ready

    def forget(self, endpoint: str) -> None:
        """The endpoint was removed: never re-connect it."""
        self._due.pop(endpoint, None)

    def close(self) -> None:
        """Detach the monitor from the watched socket, then close the monitor socket.

        The order matters: libzmq sends monitor events from the context's I/O
        thread with a blocking send, so the watched socket's next event after
        the reader closed (a reconnect attempt to a pod that went away) blocks
        that thread for good, and with it every socket of the context, the
        process-wide one included.
        """
        with contextlib.suppress(zmq.ZMQError):
            self._watched.disable_monitor()
        self.socket.close(linger=0)
