"""Decision rounds before ingest, across every deployment of one operator process.

Each deployment's subscriber thread receives and ingests as fast as messages
come; under overload those threads take all the CPU (and the GIL) the process
has, and a decision round, one thread among them, would wait seconds for its
share. While any round runs, subscriber threads pause between receives (ZMQ
keeps what arrives meanwhile, bounded by its high-water marks; what does not fit
is counted as gaps), so a round takes what it needs of the CPU first. Rounds
are short (tens of milliseconds), so in normal operation this costs ingest a
few per cent of its time and nothing it receives.
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
    """How many decision rounds are running; subscriber threads wait while any is."""

    def __init__(self) -> None:
        self._running = 0
        self._idle = threading.Condition()

    @contextmanager
    def round(self) -> Iterator[None]:
        """Mark a decision round as running for the duration of the block."""
        with self._idle:
            self._running += 1
        try:
            yield
        finally:
            with self._idle:
                self._running -= 1
                if self._running == 0:
                    self._idle.notify_all()

    def wait_for_rounds(self, timeout_s: float = MAX_PAUSE_S) -> bool:
        """Block while rounds run (at most ``timeout_s``); True if one was running."""
        if not self._running:  # the common case, without taking the condition's lock
            return False
        with self._idle:
            self._idle.wait_for(lambda: self._running == 0, timeout_s)
        return True


# One per process: the operator's deployments share its CPU.
ROUNDS = RoundPriority()
