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

A request's first passes are no stationary draw, though: it comes out of its own
prefill, and the prompts queued behind it or sent with it (a clump of parallel
calls) are prefilled next. Where the streams measure it
(:mod:`~stepscale_operator.early_prefills`: over the passes right after each
finished prefill, the share that carry prefill over the share at large, and how
much more that count varies than a binomial's), the count among a short
request's ``m`` intervals is a beta-binomial of the chain's share times that
lift and of that overdispersion. On held fleets of the simulator this took the
p99 ITL's median error on silence-burst at 3 replicas from -30.7% to -11.9% and
on bursty code at 6 from -18.8% to -10.7%, and the share of requests above the
predicted p99 from 2.2% and 2.0% to 1.5% and 1.6% (the trace, heavy prompts and
long context within 0.7 points of before; docs/planner-history.md).

Long outputs average many passes, but not so many that every prompt is alike:
where prompts vary in length (a few of many chunks among many short ones), the
extra time a long request's passes carry is a compound sum, skewed by the rare
long prompts. When the prompt mix is known
(:class:`~stepscale_operator.prompt_mix.PromptMix`), it is computed as
one: the prompts arriving during the request's ``m`` passes are a negative
binomial count (mean per pass, variance the arrival dispersion times that), each
adding its chunks' extra time (at most ``m`` chunks), and the distribution of the
sum comes from its characteristic function on a grid (FFT). A prompt rarer than
the tail moves the variance but not the quantile, which a normal cannot show. On
the Azure trace the normal this replaced put the p99 of long outputs 6% low (its
variance counted chunks, not the prompts they come in); the compound sum puts it
within 1%. A balancing router sends each prompt to the replica with the fewest
requests, so on a roomy fleet fewer requests see a prefill than a uniform spread
implies: the caller scales the prompts per pass by the exposure it measures (see
:func:`~stepscale_operator.router_pick.prefill_exposure_at`); without it, heavy-tailed
prompts on a roomy fleet put the p99 up to 27% high.

A request's passes also read its own KV. Over a large batch one request's context
moves a pass little, but over the small batches of long-context traffic it sets
the pass: an 8B model reading 126k tokens of KV alone takes ~12 ms a pass, at 5k
tokens ~7 ms. The ITL is then a mixture over prompt lengths, each request's
distribution shifted by what its context adds to a pass (``own_context``). On the
long-context scenario the simulated ITL's median rose from 6.8 to 12.5 ms from the
shortest prompts to the longest, and the p99 was the longest prompts' ITL; taken
as every request at the mean context, the prediction put the p99 at half of it.

The longest prompts' requests meet more prefill than the others, too. A prompt
of ``n`` chunks holds the prefill budget for ``n - 1`` passes, and the prompts
that arrive meanwhile wait behind it and are prefilled in its request's first
passes: on average the rate times those passes' time (``behind``, per prompt
class), which long outputs add to the prompts they meet. On the long-context
scenario held at 9 replicas, 14% of the requests with prompts over 60k tokens
were above their window's predicted p99 ITL (of all requests 2.3%; heavy
prompts at 8 show the same rise, 0.9% below 2k tokens to 22% over 60k); with
the prompts behind, 1.7% of all.

The distribution (:class:`ItlDistribution`) gives the quantile the planner aims
at and the share of requests above any limit: where the quantile falls only
slowly with the replica count, the planner judges a count by that share instead
(see :func:`~stepscale_operator.capacity_need.slo_within_reach`).

Pure functions; :func:`~stepscale_operator.latency_model.predict_latency` calls
:func:`itl_distribution`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
import numpy.typing as npt

from stepscale_operator.early_prefills import EarlyPrefills, beta_binomial_rows
from stepscale_operator.prompt_mix import PromptMix
from stepscale_operator.quantile_search import FloatArray, exceedance_quantile_on_grid


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

    def after_first_token(
        self, longest: int, early: EarlyPrefills | None
    ) -> list[npt.NDArray[np.float64]]:
        """As :meth:`count_distributions`, for the passes right after a request's
        first token: where the streams measured them (``early``), a beta-binomial
        of the chain's share times the measured lift and of the measured
        overdispersion; else the chain from its stationary state."""
        if early is None:
            return self.count_distributions(longest)
        lift, rho = early.up_to(longest)
        rows = beta_binomial_rows(np.minimum(self.share * lift, 1.0), rho)
        return [rows[m - 1, : m + 1] for m in range(1, longest + 1)]


@dataclass(frozen=True)
class PassTimes:
    """Pass times the ITL is made of, seconds."""

    decode_s: float  # a decode-only pass (f_d)
    prefill_s: float  # a pass that carries a prefill chunk (f_p, its mean)
    mean_s: float  # the mean pass (the steady-state step)


# Intervals (m = output tokens - 1) up to which the count of prefill passes is
# computed exactly on the chain; longer requests are normal around the mean pass.
EXACT_INTERVALS = 32


@dataclass(frozen=True)
class ItlDistribution:
    """The requests' ITL (seconds) as the share of them above each value."""

    exceed: Callable[[FloatArray], FloatArray]  # vectorised, non-increasing
    lo: float  # no request's ITL is below this
    hi: float  # a guess at the far tail (the quantile search doubles it if short)

    def quantile(self, tail: float) -> float:
        """The ITL exceeded by a share ``tail`` of requests."""
        return exceedance_quantile_on_grid(self.exceed, self.lo, self.hi, tail)

    def share_above(self, itl_s: float) -> float:
        """The share of requests whose ITL exceeds ``itl_s``."""
        return float(self.exceed(np.array([itl_s]))[0])


def itl_distribution(
    passes: PassTimes,
    chain: PrefillPassChain,
    interval_bins: tuple[tuple[int, int, float], ...],
    variance_per_pass: float,
    prompts: PromptMix | None = None,
    mean_intervals: float = 0.0,
    own_context: tuple[tuple[float, float], ...] = ((0.0, 1.0),),
    early: EarlyPrefills | None = None,
    behind: tuple[float, ...] = (),
) -> ItlDistribution:
    """The ITL of requests with an ITL, as a distribution.

    ``interval_bins`` holds (first, last, share): the share of requests whose
    output has between ``first`` and ``last`` intervals (tokens - 1), each count in
    the bin equally likely; requests of one token (0 intervals) have no ITL and are
    left out, and what the bins leave of 1 has more intervals than the last bin.
    ``variance_per_pass`` is the variance of the prefill-pass count per pass in a
    long window (see :class:`PrefillPassChain`). With ``prompts``, long outputs
    take the compound distribution of their extra time (see the module docstring);
    without, a normal around the mean pass. ``mean_intervals``, the mean over all
    requests, places the outputs longer than the bins (0: just past the last bin).
    ``own_context`` holds (seconds, share): what a request's own KV adds to each of
    its passes over the mean request's, and the share of requests that long (see
    the module docstring); the ITL is the mixture of the distributions so shifted.
    ``early``, where measured, gives short outputs the prefill passes a request
    meets right after its first token (:meth:`PrefillPassChain.after_first_token`).
    ``behind``, per ``own_context`` class, the prompts queued behind its own
    prefill on average, which long outputs meet too (see the module docstring;
    empty: none).
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
        # Longer outputs, at the mean length the overall mean leaves them.
        binned = sum(share * (first + end) / 2.0 for first, end, share in interval_bins)
        rest_mean = (mean_intervals - binned) / rest if mean_intervals > 0.0 else 0.0
        points.append((max(last + 1, round(rest_mean)), rest))
    with_itl = sum(share for _, share in points)
    if with_itl <= 0.0:
        return _point(passes.mean_s)
    extra = max(passes.prefill_s - passes.decode_s, 0.0)
    # Short outputs: every (ITL, probability) the chain gives, sorted, so the share
    # above x is one search.
    exact = [(m, share) for m, share in points if m <= EXACT_INTERVALS]
    values: list[npt.NDArray[np.float64]] = []
    weights: list[npt.NDArray[np.float64]] = []
    if exact:
        dists = chain.after_first_token(max(m for m, _ in exact), early)
        for m, share in exact:
            values.append(passes.decode_s + extra * np.arange(m + 1) / m)
            weights.append(share * dists[m - 1])
    vals = np.concatenate(values) if values else np.zeros(0)
    order = np.argsort(vals)
    vals = vals[order]
    above = np.concatenate(
        [np.cumsum((np.concatenate(weights) if weights else vals)[order][::-1])[::-1], [0.0]]
    )
    # Long ones: the compound sum when the prompt mix is known, else a normal.
    long_points = [(m, share) for m, share in points if m > EXACT_INTERVALS]
    hi = max(passes.prefill_s, passes.mean_s) + 8.0 * extra
    if prompts is None:
        normals = []
        for m, share in long_points:
            sd = extra * math.sqrt(max(variance_per_pass, 0.0) / m)
            normals.append((share, NormalDist(passes.mean_s, max(sd, 1e-12))))

        def exceed(x: FloatArray) -> FloatArray:
            total = above[np.searchsorted(vals, x, side="right")]
            for share, dist in normals:
                total = total + share * np.array([1.0 - dist.cdf(float(v)) for v in x])
            return total / with_itl

        return _mixture(exceed, own_context, passes.decode_s, hi)
    # Per own-context class, the prompts queued behind its prefill: one CDF row
    # per distinct count, every class's row on one grid per span (close counts
    # share transforms; see prompt_mix).
    kept = [(i, shift, share) for i, (shift, share) in enumerate(own_context) if share > 0.0]
    kept = kept or [(0, 0.0, 1.0)]
    queued = np.array([behind[i] if len(behind) == len(own_context) else 0.0 for i, _, _ in kept])
    levels, row_of = np.unique(np.maximum(queued, 0.0), return_inverse=True)
    shifts = np.array([shift for _, shift, _ in kept])
    shares = np.array([share for _, _, share in kept])
    shares = shares / shares.sum()
    ms = np.array([m for m, _ in long_points], dtype=np.float64)
    m_shares = np.array([share for _, share in long_points])
    table = prompts.extra_cdf_table(ms, levels)

    def mixed(x: FloatArray) -> FloatArray:
        # (values, classes): each class's ITL moved by its own context.
        y = x[:, None] - shifts[None, :]
        total = above[np.searchsorted(vals, y, side="right")]
        if ms.size:
            # (m, values, classes): the extra time, in grid steps of each m.
            at = (y[None, :, :] - passes.decode_s) * (ms / table.steps)[:, None, None]
            total = total + np.tensordot(m_shares, 1.0 - table.cdf_at(at, row_of), axes=1)
        return (total / with_itl) @ shares

    # The tail's guess grows with the prompts behind (the search doubles it if short).
    hi += float(levels.max()) * max((n * e for n, e, _ in prompts.classes), default=0.0)
    return ItlDistribution(mixed, passes.decode_s + float(shifts.min()), hi + float(shifts.max()))


def normal_itl_distribution(
    mean_s: float, sd_s: float, own_context: tuple[tuple[float, float], ...]
) -> ItlDistribution:
    """Each request's ITL normal (``mean_s``, ``sd_s``), shifted by its own context."""
    dist = NormalDist(mean_s, max(sd_s, 1e-12))

    def exceed(x: FloatArray) -> FloatArray:
        return np.array([1.0 - dist.cdf(float(v)) for v in x])

    return _mixture(exceed, own_context, mean_s - 8.0 * sd_s, mean_s + 8.0 * sd_s)


def _point(itl_s: float) -> ItlDistribution:
    """Every request at one ITL."""

    def exceed(x: FloatArray) -> FloatArray:
        return (x < itl_s).astype(np.float64)

    return ItlDistribution(exceed, itl_s, itl_s)


def _mixture(
    exceed: Callable[[FloatArray], FloatArray],
    own_context: tuple[tuple[float, float], ...],
    lo: float,
    hi: float,
) -> ItlDistribution:
    """The mixture of ``exceed`` (vectorised; its tail lies between ``lo`` and ``hi``)
    shifted by each (seconds, share) class."""
    kept = [(shift, share) for shift, share in own_context if share > 0.0] or [(0.0, 1.0)]
    shifts = np.array([shift for shift, _ in kept])
    shares = np.array([share for _, share in kept])
    shares = shares / shares.sum()

    def mixed(x: FloatArray) -> FloatArray:
        return exceed((x[:, None] - shifts[None, :]).ravel()).reshape(x.size, -1) @ shares

    return ItlDistribution(mixed, lo + float(shifts.min()), hi + float(shifts.max()))
