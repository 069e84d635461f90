"""Decision rounds before ingest, and one at a time, across one operator process.

Each deployment's subscriber thread receives and ingests as fast as messages
come; under overload those threads take all the CPU (and the GIL) the process
has, and a decision round, one thread among them, would wait seconds for its
share. So, while any round runs:

* subscriber threads pause between receives (ZMQ keeps what arrives meanwhile,
  bounded by its high-water marks; what does not fit is counted as gaps) and
  leave their queued messages to the round (see ``DeploymentAutoscaler``), so a
  round takes what it needs of the CPU first;
* rounds of other deployments wait their turn: overlapping rounds would share
  the GIL and the CPU, and each would take as long as all of them together.
  With both, under a 0.1-core limit and 4x overload (benchmarks/bench_operator_ingest.py,
  evenly paced), the round p99 went from 6.0-8.7 s to 2.9-3.6 s and the messages
  received per second from 12.5k to 19k (the excess shed, counted, instead of
  waiting in ZMQ).

Rounds are short (tens of milliseconds), so in normal operation this costs ingest
a few per cent of its time and nothing it receives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

# The longest a subscriber thread waits for rounds to finish before it receives
# again (a round that hangs must not stop ingest for good). Long: under a CPU
# limit a round is one runnable thread among a dozen, and subscribers that resume
# after a short pause take most of the CPU back (1 s: round p50 1.1-6.7 s at 0.1
# core and 20k msg/s; 10 s: 0.6-0.8 s). What arrives meanwhile waits in ZMQ, up to
# its high-water mark per connection (subscriber.DEFAULT_RCVHWM), then counts as gaps.
MAX_PAUSE_S = 10.0


class RoundPriority:
    """How many decision rounds are running (subscriber threads wait while any is);
    runs them one at a time."""

    def __init__(self) -> None:
        self._running = 0  # rounds running or waiting for their turn
        self._idle = threading.Condition()
        self._turn = threading.RLock()

    @property
    def running(self) -> bool:
        """Whether a round is running or waiting for its turn (a racy read: enough for
        a subscriber thread deciding whether to ingest now or leave it to the round)."""
        return self._running > 0

    @contextmanager
    def round(self) -> Iterator[None]:
        """Run the block as a decision round: subscriber threads wait, and so do other
        rounds until it ends."""
        with self._idle:
            self._running += 1
        try:
            with self._turn:
                yield
        finally:
            with self._idle:
                self._running -= 1
                if self._running == 0:
                    self._idle.notify_all()

    def wait_for_rounds(self, timeout_s: float = MAX_PAUSE_S) -> bool:
        """Block while rounds run (at most ``timeout_s``); True if one was running."""
        if not self.running:  # the common case, without taking the condition's lock
            return False
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0, timeout_s)
        return True


# One per process: the operator's deployments share its CPU.
ROUNDS = RoundPriority()
