"""The ITL quantile over requests of measured output lengths.

A request that generates ``L`` tokens has ``m = L - 1`` inter-token intervals,
one forward pass each, and its ITL is their mean. A pass is either a decode pass
(``f_d``) or one that also carries a prefill chunk (``f_p``); a share ``pi`` of
passes carry one. Long outputs average many passes, so their ITL is close to the
mean pass and a normal approximation serves. Short outputs do not: a request of 2
tokens whose one interval is a prefill pass has an ITL of ``f_p``, several times
the mean. Where short outputs are common (code completion, classification), they
set the p99 alone: on the bursty code scenario, a model that took every request
for a long one predicted half the simulated p99 and matched that of the requests
with more than 10 tokens.

Whether consecutive passes carry prefill is correlated (a prompt of several chunks,
prompts arriving together), so the passes are a two-state Markov chain whose
stationary share is ``pi`` and whose correlation ``lam`` gives the variance the
load's shape implies for long windows: per pass, ``Var(K_m) / m -> pi * (D + cv2)``
with ``D`` the arrival dispersion and ``cv2`` that of the prefill service (the same
variance the normal approximation uses). The count ``K_m`` of prefill passes among
a short request's ``m`` intervals is computed exactly on that chain.

Pure functions; :func:`~stepscale_operator.latency_model.predict_latency` calls
:func:`itl_quantile`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from stepscale_operator.quantile_search import exceedance_quantile


@dataclass(frozen=True)
class PrefillPassChain:
    """Which passes carry prefill: a two-state Markov chain over consecutive passes."""

    share: float  # stationary share of passes with prefill (pi)
    stay: float  # P(prefill pass | previous one was prefill)
    enter: float  # P(prefill pass | previous one was decode only)

    @classmethod
    def of(cls, share: float, variance_per_pass: float) -> PrefillPassChain:
        """The chain with stationary ``share`` whose count of prefill passes in a long
        window has ``variance_per_pass`` per pass (at least the independent
        ``share * (1 - share)``: the chain is never anti-correlated)."""
        pi = min(max(share, 0.0), 1.0)
        if pi <= 0.0 or pi >= 1.0:
            return cls(pi, pi, pi)
        # Var(K_m)/m -> pi (1 - pi) (1 + lam) / (1 - lam) for a two-state chain.
        ratio = max(variance_per_pass / (pi * (1.0 - pi)), 1.0)
        lam = (ratio - 1.0) / (ratio + 1.0)
        return cls(pi, pi + lam * (1.0 - pi), pi * (1.0 - lam))

    def count_distributions(self, longest: int) -> list[npt.NDArray[np.float64]]:
        """For m = 1..``longest``: P(K = k), k = 0..m, the prefill passes among ``m``
        consecutive passes from the stationary state (entry ``m - 1``)."""
        # decode[k] / prefill[k]: probability of k prefill passes so far, the last
        # pass decode only / prefill.
        decode = np.zeros(longest + 1)
        prefill = np.zeros(longest + 1)
        decode[0] = 1.0 - self.share
        prefill[1] = self.share
        out = [decode[:2] + prefill[:2]]
        for m in range(2, longest + 1):
            nd = decode * (1.0 - self.enter) + prefill * (1.0 - self.stay)
            npf = np.zeros(longest + 1)
            npf[1:] = decode[:-1] * self.enter + prefill[:-1] * self.stay
            decode, prefill = nd, npf
            out.append(decode[: m + 1] + prefill[: m + 1])
        return out


@dataclass(frozen=True)
class PassTimes:
    """Pass times the ITL is made of, seconds."""

    decode_s: float  # a decode-only pass (f_d)
    prefill_s: float  # a pass that carries a prefill chunk (f_p, its mean)
    mean_s: float  # the mean pass (the steady-state step)


# Intervals (m = output tokens - 1) up to which the count of prefill passes is
# computed exactly on the chain; longer requests are normal around the mean pass.
EXACT_INTERVALS = 32


def itl_quantile(
    passes: PassTimes,
    chain: PrefillPassChain,
    interval_bins: tuple[tuple[int, int, float], ...],
    variance_per_pass: float,
    tail: float,
) -> float:
    """The ITL (seconds) exceeded by a share ``tail`` of requests with an ITL.

    ``interval_bins`` holds (first, last, share): the share of requests whose
    output has between ``first`` and ``last`` intervals (tokens - 1), each count in
    the bin equally likely; requests of one token (0 intervals) have no ITL and are
    left out, and what the bins leave of 1 has more intervals than the last bin.
    ``variance_per_pass`` is the variance of the prefill-pass count per pass in a
    long window (see :class:`PrefillPassChain`).
    """
    points: list[tuple[int, float]] = []  # (intervals, share of requests)
    last = 0
    for first, end, share in interval_bins:
        last = max(last, end)
        first = max(first, 1)
        if share <= 0.0 or end < first:
            continue
        counts = range(first, end + 1)
        if end - first + 1 > 4:
            counts = range(first, end + 1, max((end - first) // 4, 1))
        for m in counts:
            points.append((m, share / len(counts)))
    rest = max(1.0 - sum(share for _, _, share in interval_bins), 0.0)
    if rest > 0.0:
        points.append((last + 1, rest))
    with_itl = sum(share for _, share in points)
    if with_itl <= 0.0:
        return passes.mean_s
    extra = max(passes.prefill_s - passes.decode_s, 0.0)
    # Short outputs: every (ITL, probability) the chain gives, sorted, so the share
    # above x is one search; long ones: normal around the mean pass.
    exact = [(m, share) for m, share in points if m <= EXACT_INTERVALS]
    values: list[npt.NDArray[np.float64]] = []
    weights: list[npt.NDArray[np.float64]] = []
    if exact:
        dists = chain.count_distributions(max(m for m, _ in exact))
        for m, share in exact:
            values.append(passes.decode_s + extra * np.arange(m + 1) / m)
            weights.append(share * dists[m - 1])
    vals = np.concatenate(values) if values else np.zeros(0)
    order = np.argsort(vals)
    vals = vals[order]
    above = np.concatenate(
        [np.cumsum((np.concatenate(weights) if weights else vals)[order][::-1])[::-1], [0.0]]
    )
    normals = [
        (
            share,
            NormalDist(
                passes.mean_s, max(extra * math.sqrt(max(variance_per_pass, 0.0) / m), 1e-12)
            ),
        )
        for m, share in points
        if m > EXACT_INTERVALS
    ]

    def exceed(x: float) -> float:
        total = float(above[np.searchsorted(vals, x, side="right")])
        for share, dist in normals:
            total += share * (1.0 - dist.cdf(x))
        return total / with_itl

    if exceed(passes.decode_s) <= tail:
        return passes.decode_s
    hi = max(passes.prefill_s, passes.mean_s) + 8.0 * extra
    return exceedance_quantile(exceed, passes.decode_s, hi, tail)
