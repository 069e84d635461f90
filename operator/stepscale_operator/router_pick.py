"""Where a router sends a new prompt, and which decode requests its prefill delays.

A replica's prefill passes delay the decode requests that replica holds. Behind a
router that balances on outstanding requests, a prompt goes to a replica holding
few, so its prefill delays fewer decodes than the mean batch: the *exposure*. The
load estimate measures it at the fleet size it was measured on (the decode
requests prefill-bearing passes carry fewer than the mean pass:
``prefill_pass_decode_deficit``); the planner needs it at every count it
considers, and there it is not constant.

Over batches below one (long prompts, a roomy fleet) the exposure falls steeply
with the fleet: a prompt delays decodes only when no replica is free. On the
long-context scenario, 6 -> 8 -> 12 -> 16 fixed replicas put 45.9, 17.1, 2.4 and
0.2 prompt tokens beside a decode token, and the p99 ITL at 38, 24, 12 and 12 ms.
Holding the measured deficit at every count made the prediction almost flat in
the count: from 6 replicas, 12 were predicted at 1.65x their simulated p99 ITL,
and from 12, 6 were predicted at 0.65x, so the planner scaled down too far, missed,
then scaled up far beyond the need (18 where 12 served).

Two models bound what the router's pick holds: replicas independent of one another
(:func:`least_loaded_queue`: each replica's count its own, so some replica is often
free) and replicas kept within one request of one another
(:func:`balanced_pick_decodes`: none is free until the fleet holds a request per
replica). The first alone puts too few decodes at the pick: used for every count,
it predicted 8 replicas' p99 ITL at 0.62-0.66x the simulated, from every measured
count. The measurement at its own count places the real router between the two
(:func:`prefill_exposure_at`), and that place is carried to the other counts: the
predictions from 6, 8, 12 and 16 replicas at each other count then came within
0.83-1.39x of the simulated (0.61-1.87x before; the ratios at the measured count
itself, 0.83-1.05x, are unchanged). Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

# Deepest prompt queue counted behind one replica's prefill (the tail is geometric).
_MAX_QUEUE_DEPTH = 64


@dataclass(frozen=True)
class RouterPick:
    """What a new prompt finds on the replica the router sends it to."""

    prefilling: float  # chance a prompt is prefilling there
    queued: float  # mean prompts queued there beyond the one in progress
    decodes: float  # mean decode requests there (what its prefill passes delay)

    @classmethod
    def at_random(cls, busy: float, queued_per_busy: float, batch: float) -> RouterPick:
        """A replica picked whatever it holds: busy with chance ``busy``, and then
        ``queued_per_busy`` prompts queued on average; ``batch`` decodes on average."""
        return cls(busy, busy * queued_per_busy, max(batch, 0.0))


def least_loaded_queue(
    replicas: int,
    batch: float,
    busy: float,
    queued_per_busy: float,
    prefilling_batches: tuple[tuple[float, float], ...] = (),
) -> RouterPick:
    """What a least-outstanding router's pick holds, replicas taken as independent.

    A replica holds its decode requests, Poisson with mean ``batch`` (the count of
    an infinite-server queue), plus its prompts: none with chance ``1 - busy``,
    else one in progress and a geometric number queued behind it, of mean
    ``queued_per_busy``. While it prefills, its decodes are a mixture of Poissons,
    ``prefilling_batches`` holding (mean, weight) (none: Poisson with mean
    ``batch``): during a prefill far longer than a decode lives, the decodes
    finish and none join, so that replica comes to hold little more than the
    prompt, and the router picks it. A real balancing router keeps the totals far
    tighter (variance 0.3-0.5 in the simulator) and a replica starts prefilling just when
    an arrival raises its total; counted there, the chance of a prefill is 12-25%
    high over large batches and 1.5-14x low over batches of about one (see the
    README). The router picks the replica holding the fewest (ties at random), so
    over large decode batches a prefill is lost in the batches' spread and the pick
    is a random replica's; over small ones, or with empty replicas, a replica with
    prompts, and more so one with a queue, is rarely the least loaded. One
    replica: it is picked whatever it holds.
    """
    busy = min(max(busy, 0.0), 1.0)
    queued_per_busy = max(queued_per_busy, 0.0)
    if replicas <= 1 or busy in (0.0, 1.0):
        return RouterPick.at_random(busy, queued_per_busy, batch)
    batch = max(batch, 0.0)
    mixture = [(min(max(m, 0.0), batch), w) for m, w in prefilling_batches if w > 0.0]
    during = min((m for m, _ in mixture), default=batch)
    # Prompts held: 0, then 1, 2, ... with a geometric tail (ratio ``sigma``).
    sigma = queued_per_busy / (1.0 + queued_per_busy)
    depth = 1
    if sigma > 0.0:
        depth = max(1, min(_MAX_QUEUE_DEPTH, int(math.log(1e-9) / math.log(sigma)) + 1))
    q = np.arange(depth + 1)
    prompts = np.where(q == 0, 1.0 - busy, busy * (1.0 - sigma) * sigma ** np.maximum(q - 1, 0))
    low = max(0, int(during - 12.0 * math.sqrt(during) - 20.0))
    high = int(batch + 12.0 * math.sqrt(batch) + 20.0) + 1
    k = np.arange(low, high + 1)
    idle_decodes = _poisson(batch, low, k)
    busy_decodes = idle_decodes
    if mixture:
        total = sum(w for _, w in mixture)
        busy_decodes = np.sum([w / total * _poisson(m, low, k) for m, w in mixture], axis=0)
    idle_prompts = np.where(q == 0, prompts, 0.0)
    busy_prompts = np.where(q >= 1, prompts, 0.0)
    # Index i of each: a replica holding low + i requests in all, decodes and prompts.
    held = np.convolve(idle_decodes, idle_prompts) + np.convolve(busy_decodes, busy_prompts)
    prefilling = np.convolve(busy_decodes, busy_prompts)
    queued = np.convolve(busy_decodes, np.maximum(q - 1, 0) * prompts)
    decoding = np.convolve(k * idle_decodes, idle_prompts) + np.convolve(
        k * busy_decodes, busy_prompts
    )
    beyond = np.concatenate([np.cumsum(held[::-1])[::-1], [0.0]])  # P(holds >= low + i)
    fewest_here = beyond[:-1] ** replicas - beyond[1:] ** replicas
    ok = held > 0.0
    share = np.where(ok, fewest_here / np.where(ok, held, 1.0), 0.0)
    return RouterPick(
        min(float((share * prefilling).sum()), 1.0),
        float((share * queued).sum()),
        float((share * decoding).sum()),
    )


def _poisson(mean: float, low: int, k: npt.NDArray[np.int64]) -> npt.NDArray[np.float64]:
    """P(K = k) for a Poisson count of ``mean``, over ``k`` (consecutive, from ``low``)."""
    if mean <= 0.0:
        return (k == 0).astype(float)
    log_factorial = math.lgamma(low + 1) + np.concatenate(([0.0], np.cumsum(np.log(k[1:]))))
    out: npt.NDArray[np.float64] = np.exp(k * math.log(mean) - mean - log_factorial)
    return out


def balanced_pick_decodes(
    replicas: int, batch: float, busy: float, queued_per_busy: float
) -> float:
    """Mean decode requests on the replica a router picks that keeps every replica's
    outstanding requests within one of the others'.

    The fleet holds a Poisson number of requests (mean ``replicas`` times a
    replica's decodes ``batch`` plus its prompts: ``busy`` times one in progress
    and ``queued_per_busy`` queued); the pick holds the floor of their share, of
    which decodes are their part of a replica's mean.
    """
    n = max(replicas, 1)
    batch = max(batch, 0.0)
    per = batch + min(max(busy, 0.0), 1.0) * (1.0 + max(queued_per_busy, 0.0))
    if batch <= 0.0:
        return 0.0
    total = n * per
    top = int(total + 12.0 * math.sqrt(total) + 20.0)
    held = np.arange(top + 1)
    log_pmf = held * math.log(total) - total - np.array([math.lgamma(h + 1.0) for h in held])
    return float((np.exp(log_pmf) * (held // n)).sum()) * batch / per


def prefill_exposure(deficit: float, batch: float) -> float:
    """The decode requests a prefill pass delays, relative to the mean decode batch
    over time (``batch``): 1 when prompts land anywhere; less when the router sends
    them to replicas with ``deficit`` fewer decode requests than the mean pass
    carries (0: none measured, taken as 1).

    A pass runs only while the replica holds a request, so the mean *pass* carries
    at least one decode request (the deficit is measured over passes): a prefill
    pass carries ``max(batch, 1) - deficit``. The latency model counts the prompts
    that reach a request over time (per unit time, scaled to a pass by the mean
    step), so that is set against the batch over time, idle time included: over
    batches below one, a prefill pass can carry more decodes than the replica holds
    on average. Taken against the batch of a pass instead, long-context traffic on 8
    replicas (0.6 decodes each) put the share of decode tokens in prefill passes at
    a third of what its passes measured, and the p99 ITL 23% low.
    """
    if deficit <= 0.0 or batch <= 0.0:  # unmeasured, or no decodes to delay
        return 1.0
    return max(max(batch, 1.0) - deficit, 0.0) / batch


def prefill_exposure_at(
    deficit: float,
    measured_replicas: int,
    replicas: int,
    batch: float,
    busy: float,
    queued_per_busy: float,
    balanced: bool,
) -> float:
    """The exposure (see :func:`prefill_exposure`) at ``replicas``, of a deficit
    measured at ``measured_replicas`` (0: at ``replicas``).

    ``batch``, ``busy`` and ``queued_per_busy`` are one replica's at ``replicas``
    (decodes over time, the chance a prompt is in progress, the prompts queued
    behind one); at the measured count the same fleet-wide load is split over
    fewer or more. There the measured decodes at a prefill pass place the router
    between the independent and the balanced model (a weight in their logarithms);
    beyond either, the difference is kept. At the measured count this is
    :func:`prefill_exposure`. A random router's pick is any replica, whatever the
    count, so there the measured exposure is kept.
    """
    if deficit <= 0.0 or batch <= 0.0:
        return 1.0
    n = max(replicas, 1)
    n0 = measured_replicas if measured_replicas > 0 else n
    batch0 = batch * n / n0
    busy0 = min(max(busy, 0.0) * n / n0, 1.0)
    measured = prefill_exposure(deficit, batch0)
    if n0 == n or not balanced:
        return measured
    at_pass0 = measured * batch0  # decodes a prefill pass carries there

    def bounds(k: int, b: float, u: float) -> tuple[float, float]:
        independent = max(least_loaded_queue(k, b, u, queued_per_busy).decodes, 1e-12)
        return independent, max(balanced_pick_decodes(k, b, u, queued_per_busy), independent)

    low0, high0 = bounds(n0, batch0, busy0)
    low, high = bounds(n, batch, busy)
    span = math.log(high0 / low0)
    weight = 0.5
    if span > 1e-9:
        placed = math.log(max(at_pass0, 1e-12) / low0) / span
        weight = min(max(placed, 0.0), 1.0)
    between0 = low0 ** (1.0 - weight) * high0**weight
    between = low ** (1.0 - weight) * high**weight
    return max(between + at_pass0 - between0, 0.0) / batch
