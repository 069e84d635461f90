"""FPM identities that no current pod backs: counted, remembered a while, then forgotten (pure).

A deployment's streams follow its pods. Two kinds of message arrive from other
identities: messages still in flight when a pod was deleted (its stream was
dropped a moment before they were read), and identities that are no pod at all
(a misconfigured or hostile publisher). Neither may count as missing load: a
silent "stream" that no pod backs would hold the planner forever. So they never
reach the load estimate or the cost model; they are counted here, and each
identity is forgotten once it has been silent for ``expire_after_s``.

Memory is bounded by ``max_remembered`` identities (the longest silent go
first); the message count is exact whatever is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from stepscale_operator.stream_state import StreamKey

DEFAULT_EXPIRE_AFTER_S = 60.0
DEFAULT_MAX_REMEMBERED = 1024


class StrayStreams:
    """Messages from identities that are not (or no longer) a pod's stream."""

    def __init__(
        self,
        expire_after_s: float = DEFAULT_EXPIRE_AFTER_S,
        max_remembered: int = DEFAULT_MAX_REMEMBERED,
    ) -> None:
        if max_remembered < 1:
            raise ValueError("max_remembered must be at least 1")
        self.expire_after_s = float(expire_after_s)
        self.max_remembered = int(max_remembered)
        self.messages = 0  # every stray message ever counted (monotonic)
        self.expired = 0  # identities forgotten (silent too long, or beyond the bound)
        self._last_seen: OrderedDict[StreamKey, float] = OrderedDict()  # oldest first

    def observe(self, counts: Iterable[tuple[StreamKey, int]], now: float) -> None:
        """Count ``(identity, messages)`` received at ``now``."""
        for key, n in counts:
            self.messages += int(n)
            self._last_seen[key] = now
            self._last_seen.move_to_end(key)
        while len(self._last_seen) > self.max_remembered:
            self._last_seen.popitem(last=False)
            self.expired += 1

    def active(self, now: float) -> int:
        """Identities heard from within ``expire_after_s`` (older ones are forgotten now)."""
        while self._last_seen:
            key, seen = next(iter(self._last_seen.items()))
            if now - seen <= self.expire_after_s:
                break
            del self._last_seen[key]
            self.expired += 1
        return len(self._last_seen)

    def __contains__(self, key: object) -> bool:
        return key in self._last_seen
