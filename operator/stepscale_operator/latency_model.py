"""Latency model: steady-state TTFT and ITL of one replica for a given load.

The planner sizes the fleet with it; the simulator's Dynamo-style baseline and
the prediction checks use the same model.

Per replica, with the load spread evenly by the router:

* Steps come in two kinds. A *prefill step* carries one chunk of a prompt
  (chunked prefill shares ``max_num_batched_tokens`` with the decodes) plus the
  decode batch; a *decode step* carries only the decode batch. Modelling the two
  kinds apart, instead of one "average" step, keeps a convex step-time function
  (memory floor, then compute bound) from being underestimated.
* Steady state is a fixed point in the mean step time ``s``: the decode batch is
  ``B = decode_tokens_per_s * s``; prompts arrive at ``r`` per second, each taking
  ``n_c`` prefill steps, so the share of time spent on the extra prefill work is
  ``r * n_c * (f_p - f_d)`` and ``s = f_d / (1 - that share)``.
* ITL is the mean step a decode is in (``f_d`` plus the exposure below times
  ``s - f_d``: what the passes' wall times weighted by their decodes measure), with
  a tail for short requests that happen to share many steps with prefills
  (binomial count of prefill steps over ``k`` tokens),
  mixed over prompt lengths: each request's passes also read its own KV, which
  over small batches of long prompts sets the tail (see ``itl_quantile``). A
  prefill delays only the decodes on the replica the router sends it to: the
  exposure, measured at the serving count and carried to the count asked about
  (see ``router_pick``).
* TTFT is the prefill service time plus the wait behind other prompts plus the
  residual of the step in progress. A prompt that lands on a replica prefilling
  waits out the prefill in progress and the prompts queued there ahead of it;
  the queue is G/G/1's per replica (Kingman's mean length, geometric; exponential
  tail for the quantile), its arrival CV^2 one replica's arrival dispersion as
  the load estimate measures it (``replica_arrival_dispersion``; assumed only
  while unmeasured). A queued prompt costs those behind it its tokens, not a
  pass of its own: the engine admits queued prompts into the next pass as far
  as its token budget goes. Behind a balancing router (``balanced_routing``:
  least outstanding requests, round robin) one replica's dispersion is far from
  the even split once assumed: 0.6, not 0.1-0.25, on the trace at 8 replicas.
  Such a router also sends a prompt away from a replica that is prefilling
  whenever that one holds more requests than another, and more so when prompts
  queue there (:func:`least_loaded_queue`): over large decode batches that
  changes little, but rare long prompts over many replicas almost never wait.
  Without it, the long-context scenario's TTFT quantile asked for up to 52
  replicas where a static 18 served every prompt that could be served in time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from stepscale_engine.wire import ScheduledRequestMetrics
from stepscale_operator.early_prefills import EarlyPrefills
from stepscale_operator.itl_quantile import (
    ItlDistribution,
    PassTimes,
    PrefillPassChain,
    itl_distribution,
    normal_itl_distribution,
)
from stepscale_operator.load_types import OUTPUT_INTERVAL_BINS, LoadEstimate, bin_tokens_or_centres
from stepscale_operator.prompt_mix import PromptMix
from stepscale_operator.quantile_search import exceedance_quantile
from stepscale_operator.router_pick import (
    RouterPick,
    least_loaded_queue,
    prefill_exposure,
    prefill_exposure_at,
)


class LatencySettings(Protocol):
    """The settings :func:`predict_latency` reads (``PlannerPolicy`` has them all)."""

    @property
    def latency_quantile(self) -> float:
        """TTFT and ITL are predicted at this quantile."""
        ...

    @property
    def prompt_tail_ratio(self) -> float:
        """The quantile prompt is this many times the mean."""
        ...

    @property
    def service_cv2(self) -> float:
        """Squared coefficient of variation of the prefill service time."""
        ...

    @property
    def balanced_routing(self) -> bool:
        """Per-replica arrivals have CV^2 = 1/replicas (a balancing router), else 1."""
        ...

    @property
    def itl_tail_output_fraction(self) -> float:
        """The ITL tail's request generates this share of the mean output."""
        ...

    @property
    def min_itl_tail_tokens(self) -> float:
        """... and at least this many tokens."""
        ...


# Step times beyond this are "the engine cannot keep up", not a latency.
_DIVERGED_STEP_S = 30.0
_FIXED_POINT_ITERATIONS = 60
_FIXED_POINT_TOLERANCE = 1e-4


class StepTimePredictor(Protocol):
    """Anything that predicts the wall time (seconds) of one forward pass."""

    def predict(self, sched: ScheduledRequestMetrics) -> float:
        """Predicted wall time of a pass that executes ``sched``, in seconds."""
        ...


@dataclass(frozen=True)
class SloTargets:
    """Latency targets: time to first token and inter-token latency, milliseconds."""

    ttft_ms: float
    itl_ms: float


@dataclass(frozen=True)
class EngineLimits:
    """Scheduler limits of one engine (vLLM's flags of the same names)."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_capacity_tokens: int = 400_000


@dataclass(frozen=True)
class PerReplicaLoad:
    """The load one replica carries when the fleet load is split evenly."""

    prefill_tokens_per_s: float
    prefill_requests_per_s: float
    decode_tokens_per_s: float
    mean_prompt_tokens: float  # full prompt, cache hits included
    mean_cached_tokens: float  # of which served from the prefix cache
    mean_decode_context_tokens: float
    # Measured shapes (see LoadEstimate): prompt lengths with their probabilities
    # (empty: only the mean is known), and the fleet's arrival dispersion (0: unknown).
    prompt_lengths: tuple[tuple[float, float], ...] = ()
    arrival_dispersion: float = 0.0
    # One replica's arrival dispersion at this count (0: unknown; see
    # :func:`replica_dispersion_at`).
    replica_arrival_dispersion: float = 0.0
    # Output lengths: (first, last intervals, share) per bin (empty: not measured).
    output_intervals: tuple[tuple[int, int, float], ...] = ()
    # Decode requests a prefill pass carries fewer than the mean pass (0: none known).
    prefill_pass_decode_deficit: float = 0.0
    # Replicas serving when the estimate was measured (0: unknown); the deficit and
    # the replica dispersion are carried from there to other counts.
    measured_replicas: int = 0
    # The prefill passes a request meets right after its first token, against the
    # share at large (None: not measured; see early_prefills).
    early_prefills: EarlyPrefills | None = None

    @classmethod
    def from_estimate(cls, load: LoadEstimate, replicas: int) -> PerReplicaLoad:
        """Split a fleet-wide estimate over ``replicas`` replicas."""
        n = max(replicas, 1)
        mean_prompt = max(load.mean_prompt_tokens, 0.0)
        cached = mean_prompt * min(max(load.prefix_cache_hit_fraction, 0.0), 1.0)
        return cls(
            prefill_tokens_per_s=max(load.prefill_tokens_per_s, 0.0) / n,
            prefill_requests_per_s=max(load.prefill_requests_per_s, 0.0) / n,
            decode_tokens_per_s=max(load.decode_tokens_per_s, 0.0) / n,
            mean_prompt_tokens=mean_prompt,
            mean_cached_tokens=cached,
            mean_decode_context_tokens=max(load.mean_decode_context_tokens, 0.0),
            prompt_lengths=prompt_distribution(
                load.prompt_histogram, mean_prompt, load.prompt_bin_tokens
            ),
            arrival_dispersion=max(load.arrival_dispersion, 0.0),
            replica_arrival_dispersion=replica_dispersion_at(
                load.replica_arrival_dispersion,
                load.arrival_dispersion,
                load.streams_total - load.streams_missing,
                n,
            ),
            prefill_pass_decode_deficit=max(load.prefill_pass_decode_deficit, 0.0),
            measured_replicas=max(load.streams_total - load.streams_missing, 0),
            early_prefills=load.early_prefills,
            output_intervals=tuple(
                (first, last, share)
                for (first, last), share in zip(
                    OUTPUT_INTERVAL_BINS, load.output_interval_shares, strict=False
                )
            ),
        )


def replica_dispersion_at(
    measured: float, fleet: float, measured_replicas: int, replicas: int
) -> float:
    """One replica's arrival dispersion at ``replicas``, from ``measured`` at
    ``measured_replicas`` (0: unknown).

    Spread at random over n replicas, arrivals of fleet dispersion D reach one
    replica with dispersion 1 + (D - 1) / n (a thinned count). A balancing router
    does better by an amount the measurement shows; that offset is kept and the
    thinning's dependence on n carried to the other count. Never below D / n, what
    an even split of every second's arrivals leaves.
    """
    if measured <= 0.0 or measured_replicas <= 0:
        return 0.0
    n = max(replicas, 1)
    if fleet <= 0.0:
        return measured
    moved = measured + (fleet - 1.0) * (1.0 / n - 1.0 / measured_replicas)
    return max(moved, fleet / n)


def prompt_distribution(
    histogram: tuple[float, ...], mean_prompt: float, bin_tokens: tuple[float, ...] = ()
) -> tuple[tuple[float, float], ...]:
    """(prompt length, probability) per non-empty histogram bin; empty when there is
    no histogram.

    Each bin's length is its measured mean (``bin_tokens`` over its count; the
    geometric centre where unmeasured, :func:`bin_tokens_or_centres`); the lengths
    are then scaled so that their mean is the measured mean prompt (measured
    exactly; the bins' means are only near where a pass held several prompts, each
    placed one standard deviation off).
    """
    total = sum(histogram)
    if total <= 0.0 or mean_prompt <= 0.0:
        return ()
    tokens = bin_tokens_or_centres(histogram, bin_tokens)
    points = [(t / h, h / total) for h, t in zip(histogram, tokens, strict=True) if h > 0.0]
    binned_mean = sum(length * p for length, p in points)
    scale = mean_prompt / binned_mean if binned_mean > 0.0 else 1.0
    return tuple((length * scale, p) for length, p in points)


@dataclass(frozen=True)
class LatencyPrediction:
    """Predicted steady-state latencies of one replica; ``inf`` when overloaded."""

    replicas: int
    ttft_ms: float  # at the planning quantile
    itl_ms: float  # at the planning quantile
    ttft_mean_ms: float
    itl_mean_ms: float  # per decode token: what the passes' wall times weighted by decodes give
    step_time_ms: float
    decode_batch: float
    prefill_utilisation: float  # share of the prompt-token capacity in use
    bottleneck: str  # "" when feasible, else what saturates
    # Share of requests whose prefill alone, on an idle replica, exceeds the TTFT
    # limit the prediction was asked about: no replica count serves them in time,
    # and ``ttft_ms`` is the quantile over the others.
    unreachable_share: float = 0.0
    # Of the other requests, the share predicted to exceed that limit (0: not asked).
    ttft_miss_share: float = 0.0
    # The share of requests whose ITL is predicted to exceed the ITL limit the
    # prediction was asked about (0: not asked).
    itl_miss_share: float = 0.0
    # Mean prefill service time of a prompt that does not wait (its passes).
    prefill_service_ms: float = 0.0
    # Prompt tokens computed in a decode token's pass, on average, as the long
    # outputs' compound sum sees them: a mean step's prompt tokens scaled by the
    # router's exposure (short outputs' chain takes every decode as exposed). A
    # diagnostic: bench_prediction.py sets it against the simulated engines'.
    prefill_tokens_per_decode: float = 0.0

    @property
    def feasible(self) -> bool:
        """False when the replica cannot keep up with the load at all."""
        return not self.bottleneck

    def within(self, slo: SloTargets, margin: float) -> bool:
        """True when both latencies are within ``(1 - margin)`` of their targets."""
        scale = 1.0 - margin
        return (
            self.feasible
            and self.ttft_ms <= slo.ttft_ms * scale
            and self.itl_ms <= slo.itl_ms * scale
        )


def _overloaded(replicas: int, bottleneck: str, step_s: float, batch: float) -> LatencyPrediction:
    return LatencyPrediction(
        replicas=replicas,
        ttft_ms=math.inf,
        itl_ms=math.inf,
        ttft_mean_ms=math.inf,
        itl_mean_ms=math.inf,
        step_time_ms=step_s * 1e3,
        decode_batch=batch,
        prefill_utilisation=1.0,
        bottleneck=bottleneck,
    )


def _ttft_exceedance(
    services: list[tuple[float, float]], wait_mean: float, p_wait: float, floor: float
) -> Callable[[float], float]:
    """P(wait + service + floor > t) as a function of t (seconds).

    The wait's tail is exponential, P(W > w) = p_wait * exp(-w * p_wait / wait_mean)
    (the M/G/1 heavy-traffic shape behind Kingman's mean, where the chance of
    waiting at all is the utilisation); ``p_wait`` is that chance and ``wait_mean``
    the mean over all prompts, waiting or not. The service is drawn from
    ``services`` ((seconds, probability), probabilities summing to 1).
    """

    def exceed(t: float) -> float:
        total = 0.0
        for s, p in services:
            w = t - s - floor
            if w < 0.0:
                total += p
            elif wait_mean > 0.0 and p_wait > 0.0:
                total += p * min(1.0, p_wait * math.exp(-w * p_wait / wait_mean))
        return total

    return exceed


def _queued_prompt_cost(
    length: float, chunks: float, chunk_pass_s: float, room: float, full_pass_s: float
) -> float:
    """Seconds a queued prompt of ``length`` computed tokens adds to the wait of
    those queued behind it.

    The engine admits queued prompts into the next pass while its token budget
    (``room`` beside the decodes) lasts, so a short prompt takes only its share of
    a pass that fills the budget (``full_pass_s``); one of a budget or more takes
    its own passes, ``chunks`` of ``chunk_pass_s``.
    """
    if length >= room:
        return chunks * chunk_pass_s
    return min(length / room * full_pass_s, chunks * chunk_pass_s)


def no_replicas_prediction() -> LatencyPrediction:
    """What zero replicas serve: nothing (infeasible, not "as if one replica")."""
    return LatencyPrediction(
        replicas=0,
        ttft_ms=math.inf,
        itl_ms=math.inf,
        ttft_mean_ms=math.inf,
        itl_mean_ms=math.inf,
        step_time_ms=math.inf,
        decode_batch=0.0,
        prefill_utilisation=math.inf,
        bottleneck="no_replicas",
    )


def _own_context_shifts(
    load: PerReplicaLoad, decode_s: float, decode_with: Callable[[float], float]
) -> tuple[tuple[float, float], ...]:
    """(seconds, share) per prompt-length class: what a request's own KV adds to a
    decode pass over the mean request's (see :mod:`~stepscale_operator.itl_quantile`).

    A request's context is its prompt plus what it has generated; the generated
    part does not depend on the prompt's length, so a class's context is the mean
    context moved by its prompt's distance from the mean prompt.
    ``decode_with(tokens)`` is the decode pass with one request's context moved by
    ``tokens``; ``decode_s`` the pass at the mean.
    """
    if len(load.prompt_lengths) < 2:
        return ((0.0, 1.0),)
    mean_prompt = sum(length * p for length, p in load.prompt_lengths)
    return tuple(
        (decode_with(length - mean_prompt) - decode_s, p) for length, p in load.prompt_lengths
    )


@dataclass(frozen=True)
class _Passes:
    """One replica's pass times, as the step-time predictor gives them."""

    predictor: StepTimePredictor
    context: float  # the mean decode request's context, tokens
    cached: float  # the mean prompt's cached tokens

    def time(self, batch: float, chunk: float, prior_kv: float, own_kv: float = 0.0) -> float:
        """A pass of ``batch`` decodes and one prefill ``chunk`` after ``prior_kv``
        tokens; ``own_kv``: one decode request's context over the mean one's."""
        # The predictor takes whole requests; interpolate between the two batch
        # sizes around a fractional mean so the fixed point moves smoothly.
        low = math.floor(batch)
        weight = batch - low

        def at(b: int) -> float:
            return self.predictor.predict(
                ScheduledRequestMetrics(
                    num_prefill_requests=1 if chunk > 0.0 else 0,
                    sum_prefill_tokens=int(round(chunk)),
                    sum_prefill_kv_tokens=int(round(prior_kv)),
                    num_decode_requests=b,
                    sum_decode_kv_tokens=(
                        int(round(max(b * self.context + own_kv, 0.0))) if b else 0
                    ),
                )
            )

        base = at(low)
        return base if weight <= 1e-9 else base + weight * (at(low + 1) - base)

    def decode(self, batch: float) -> float:
        """A pass of ``batch`` decodes and no prefill."""
        return self.time(batch, 0.0, 0.0)

    def prefill(self, length: float, room: float, batch: float) -> tuple[float, float]:
        """(chunks, time of one chunk's pass) for a prompt of ``length`` computed tokens."""
        # Fractional chunk count keeps the prediction monotone in the load.
        chunks = max(1.0, length / room)
        chunk = length / chunks
        return chunks, self.time(batch, max(chunk, 1.0), self.cached + chunk * (chunks - 1.0) / 2.0)


@dataclass(frozen=True)
class _SteadyStep:
    """The fixed point of the mean step and the decode batch it implies."""

    step: float  # mean step, seconds
    batch: float  # decode requests held, over time
    pass_batch: float  # decodes in a pass (at least one while there is decode work)
    chunk_room: float  # prompt tokens a pass has room for beside its decodes
    decode_s: float  # a pass of the mean batch without prefill
    # Per prompt-length class: (chunks, one chunk's pass in seconds, probability).
    prefills: list[tuple[float, float, float]]


def _prompt_classes(load: PerReplicaLoad) -> tuple[float, float, list[tuple[float, float]]]:
    """(prompt rate, computed tokens per prompt, (computed tokens, probability) per
    prompt-length class): the measured lengths (full prompts) scaled to the computed
    mean, or the mean alone."""
    rate = load.prefill_requests_per_s
    tokens = load.prefill_tokens_per_s
    if rate <= 0.0 and tokens > 0.0:
        rate = tokens / max(load.mean_prompt_tokens - load.mean_cached_tokens, 1.0)
    # Tokens actually computed per prompt; the cached part only adds KV reads.
    prompt = tokens / rate if rate > 0.0 else max(load.mean_prompt_tokens, 1.0)
    prompt = max(prompt, 1.0)
    if load.prompt_lengths:
        full_mean = sum(length * p for length, p in load.prompt_lengths)
        scale = prompt / full_mean if full_mean > 0.0 else 1.0
        return rate, prompt, [(max(length * scale, 1.0), p) for length, p in load.prompt_lengths]
    return rate, prompt, [(prompt, 1.0)]


def _steady_step(
    passes: _Passes,
    load: PerReplicaLoad,
    engine: EngineLimits,
    rate: float,
    prompt: float,
    classes: list[tuple[float, float]],
    replicas: int,
) -> _SteadyStep | LatencyPrediction:
    """The mean step ``s`` with ``B = decode_tokens_per_s * s`` decodes and the
    prompts' extra prefill work (module docstring), or the overload that stops it."""
    step = max(passes.decode(1.0), 1e-6)
    batch = 0.0
    f_d = step
    pass_batch = 0.0
    chunk_room = float(engine.max_num_batched_tokens)
    prefills = [(1.0, step, 1.0)]
    for _ in range(_FIXED_POINT_ITERATIONS):
        batch = load.decode_tokens_per_s * step
        if batch > engine.max_num_seqs:
            return _overloaded(replicas, "max_num_seqs", step, batch)
        if batch * passes.context + prompt + passes.cached > engine.kv_capacity_tokens:
            return _overloaded(replicas, "kv_capacity", step, batch)
        # At least one decode in the pass whenever there is decode work at all.
        pass_batch = max(batch, 1.0) if load.decode_tokens_per_s > 0.0 else 0.0
        chunk_room = engine.max_num_batched_tokens - math.ceil(pass_batch)
        if chunk_room < 1:
            return _overloaded(replicas, "token_budget", step, batch)
        f_d = passes.decode(pass_batch)
        prefills = [(*passes.prefill(length, chunk_room, pass_batch), p) for length, p in classes]
        extra_share = rate * sum(p * n * max(f - f_d, 0.0) for n, f, p in prefills)
        if extra_share >= 1.0:
            return _overloaded(replicas, "prefill_compute", step, batch)
        new_step = f_d / (1.0 - extra_share)
        if new_step > _DIVERGED_STEP_S:
            return _overloaded(replicas, "step_time", new_step, batch)
        converged = abs(new_step - step) <= _FIXED_POINT_TOLERANCE * step
        step = new_step
        if converged:
            break
    return _SteadyStep(
        step=step,
        batch=batch,
        pass_batch=pass_batch,
        chunk_room=chunk_room,
        decode_s=f_d,
        prefills=prefills,
    )


@dataclass(frozen=True)
class _PrefillQueue:
    """What a prompt finds when it arrives: the prefill server's G/G/1 queue."""

    services: list[tuple[float, float]]  # (prefill service, seconds; probability) per class
    service: float  # mean prefill service time, seconds
    service_cv2: float  # its CV^2 (measured over the classes, else the prior)
    dispersion: float  # the fleet's arrival dispersion (1 when unmeasured)
    residual: float  # the rest of a prefill in progress, on average
    admitted_mean: float  # what a queued prompt adds to the wait behind it, seconds
    rho_tokens: float  # the prefill server's utilisation, by queued tokens' cost
    queued_per_busy: float  # prompts queued behind a busy replica, on average
    busy: float  # chance a prompt is in progress where the router looks
    pick: RouterPick


def _decodes_while_prefilling(
    batch: float, rate: float, services: list[tuple[float, float]], service: float
) -> tuple[tuple[float, float], ...]:
    """Decode requests a replica holds while it prefills a prompt: (mean, weight)
    per prompt class.

    The prompt in progress is a length-biased draw of the services (weight
    ``p * S / E[S]``). During its prefill no prompt of that replica finishes, so
    no decode joins, and those it held finish at their rate: a decode lives
    ``L = batch / rate`` on average (Little), taken as exponential, so at a
    moment uniform in a prefill of ``S`` the replica holds ``batch * (L / S) *
    (1 - exp(-S / L))``. Over short prefills that is the batch; over a prefill
    of 12 s among decodes living 1.6 s it is an eighth of it.
    """
    if batch <= 0.0 or rate <= 0.0 or service <= 0.0:
        return ()
    life = batch / rate
    return tuple(
        (batch * (life / s) * -math.expm1(-s / life), p * s / service)
        for s, p in services
        if s > 0.0 and p > 0.0
    )


def _prefill_queue(
    passes: _Passes,
    steady: _SteadyStep,
    load: PerReplicaLoad,
    policy: LatencySettings,
    rate: float,
    classes: list[tuple[float, float]],
    replicas: int,
) -> _PrefillQueue | LatencyPrediction:
    """The prefill queue a prompt meets (module docstring), or the overload when
    the prompts' tokens outrun the replica."""
    # Prefill service time per class, its mean and CV^2 (measured when the prompt
    # lengths are; else the mean prompt's time and the policy's prior CV^2).
    services = [(n * f, p) for n, f, p in steady.prefills]
    service = sum(t * p for t, p in services)
    if len(services) > 1 and service > 0.0:
        service_cv2 = sum(p * (t - service) ** 2 for t, p in services) / service**2
    else:
        service_cv2 = policy.service_cv2
    dispersion = load.arrival_dispersion if load.arrival_dispersion > 0.0 else 1.0
    # TTFT: G/G/1 on the prefill server (Kingman), exponential tail for the quantile.
    # ``rho``: the share of time a replica spends on some prompt's prefill passes.
    # The engine serves its queue by tokens, not one prompt at a time: prompts that
    # wait are admitted together into the next pass as far as its budget goes, so
    # what a queued prompt costs those behind it is its tokens at a full pass's
    # throughput (``admitted``), not a pass of its own (see _queued_prompt_cost).
    rho = rate * service
    full_pass = passes.time(steady.pass_batch, steady.chunk_room, passes.cached)
    admitted = [
        (_queued_prompt_cost(length, n, f, steady.chunk_room, full_pass), p)
        for (length, _), (n, f, p) in zip(classes, steady.prefills, strict=True)
    ]
    admitted_mean = sum(t * p for t, p in admitted)
    rho_tokens = rate * admitted_mean
    if rho_tokens >= 1.0:
        return _overloaded(replicas, "prefill_queue", steady.step, steady.batch)
    # One replica's arrivals as measured (what the router leaves of the fleet's
    # clumping). Unmeasured: a balancing router taken to split each second's
    # arrivals evenly (the fleet's dispersion over ``replicas``), a random one to
    # keep it. Measured, both guesses were wrong where it mattered: a balancing
    # router over large decode batches routes by decode departures, nearly at
    # random (the trace on 8 replicas: 0.6 per replica, the guess 0.1-0.25).
    if load.replica_arrival_dispersion > 0.0:
        arrival_cv2 = load.replica_arrival_dispersion
    elif policy.balanced_routing:
        arrival_cv2 = dispersion / max(replicas, 1)
    else:
        arrival_cv2 = dispersion
    # A prompt that lands on a replica prefilling waits out the prefill in progress
    # (its residual: a length-biased draw of the service, E[S^2] / (2 E[S])) and
    # the prompts queued there ahead of it, each at its ``admitted`` cost. Prompts
    # queue behind a prefill as in Kingman's G/G/1 (mean queue rho_q * (ca2 + cs2) /
    # (2 (1 - rho_q)) per busy replica, geometric), where rho_q counts the tokens'
    # cost. At random routing this is Kingman's mean (Poisson arrivals, one prompt
    # a pass); a router that balances on outstanding requests sends a prompt
    # elsewhere when the replica that is prefilling holds more than another, and
    # more so when prompts queue there (:func:`least_loaded_queue`; without it the
    # extra wait behind a prefill came out 1.3-1.8x the simulated on fixed fleets).
    # A prompt in a clump finds the clump's earlier prompts still prefilling
    # (``dispersion - 1`` more a second, for one service time each).
    residual = service * (1.0 + service_cv2) / 2.0
    queued_per_busy = rho_tokens * (arrival_cv2 + service_cv2) / (2.0 * (1.0 - rho_tokens))
    if policy.balanced_routing:
        clump = max(dispersion - 1.0, 0.0) * min(service, 1.0) / max(replicas, 1)
        busy = min(rho + clump, 1.0)
        pick = least_loaded_queue(
            replicas,
            steady.batch,
            busy,
            queued_per_busy,
            _decodes_while_prefilling(steady.batch, rate, services, service),
        )
    else:
        busy = min(rho, 1.0)
        pick = RouterPick.at_random(busy, queued_per_busy, steady.batch)
    return _PrefillQueue(
        services=services,
        service=service,
        service_cv2=service_cv2,
        dispersion=dispersion,
        residual=residual,
        admitted_mean=admitted_mean,
        rho_tokens=rho_tokens,
        queued_per_busy=queued_per_busy,
        busy=busy,
        pick=pick,
    )


def _itl_tail(
    passes: _Passes,
    steady: _SteadyStep,
    queue: _PrefillQueue,
    load: PerReplicaLoad,
    policy: LatencySettings,
    rate: float,
    replicas: int,
) -> tuple[ItlDistribution, float]:
    """(the requests' ITL, seconds; the router's exposure it took): the mean step,
    plus the spread of a short request's mean."""
    # The prompts that arrive during a request's life are a compound count
    # (dispersion of the arrivals, variability of their sizes).
    step, f_d, prefills = steady.step, steady.decode_s, steady.prefills
    chunks_mean = sum(n * p for n, _, p in prefills)
    f_p = sum(n * f * p for n, f, p in prefills) / max(chunks_mean, 1e-9)
    _, variance_per_pass = _prefill_pass_share(steady, queue, rate)
    own_context = _own_context_shifts(
        load, f_d, lambda own: passes.time(steady.pass_batch, 0.0, 0.0, own)
    )
    if not load.output_intervals:
        # The prior: one request of a share of the mean output stands for the tail.
        mean_output = load.decode_tokens_per_s / rate if rate > 0.0 else 1.0
        tail_tokens = max(mean_output * policy.itl_tail_output_fraction, policy.min_itl_tail_tokens)
        sd = max(f_p - f_d, 0.0) * math.sqrt(variance_per_pass / tail_tokens)
        # Every decode sees the prompts: no router's exposure is measured.
        return normal_itl_distribution(step, sd, own_context), 1.0
    # Long outputs see the prompts that arrive while they decode, less those a
    # balancing router sends to replicas with fewer requests (the measured
    # deficit): the mean count scaled by the exposure. Some requests still see
    # a long prompt and others none, so the count's variance is kept (a gamma mix
    # of Poisson rates; in the bench it differs little from scaling both: bursty
    # code's ITL error 35.9% -> 28.6%, silence-burst's bias +2.8% -> +7.3%).
    # A thinned count (dispersion 1 + e (D - 1)) was tried again with the own
    # context below: long context's p99 ITL bias -37.6% -> -22.5%, but bursty
    # code's fleet shrank 6% and its attainment fell 99.31% -> 98.89%.
    short = _short_output_passes(steady, queue, load, policy, rate, replicas)
    exposure = short.exposure
    # Measured output lengths: the quantile over them (short outputs set it).
    itl = itl_distribution(
        PassTimes(f_d, f_p, step),
        short.chain,
        load.output_intervals,
        variance_per_pass,
        PromptMix(
            rate * step * exposure,
            # The same variance; where the exposure exceeds the dispersion
            # (batches below one) PromptMix keeps it at least Poisson's.
            queue.dispersion / max(exposure, 1e-3),
            tuple((n, f - f_d, p) for n, f, p in prefills),
        ),
        # Decode tokens per prompt: the mean count of intervals.
        load.decode_tokens_per_s / rate if rate > 0.0 else 0.0,
        own_context,
        # Short outputs: the lift of a request's first passes, carried to this count.
        short.early,
        # A prompt of several chunks holds the prefill budget for all but its
        # last pass; the prompts that arrive meanwhile queue behind it and are
        # prefilled in its request's first passes, so the longest prompts' own
        # requests meet the most prefill (see itl_quantile).
        tuple(rate * exposure * max(n - 1.0, 0.0) * f for n, f, _ in prefills)
        if len(prefills) == len(own_context)
        else (),
    )
    return itl, exposure


def _prefill_pass_share(
    steady: _SteadyStep, queue: _PrefillQueue, rate: float
) -> tuple[float, float]:
    """(the replica's share of passes that carry prefill, the variance per pass of
    their count over a long window): prompts per second times chunks times the
    mean pass, and that times the arrivals' dispersion plus the service's CV^2."""
    chunks_mean = sum(n * p for n, _, p in steady.prefills)
    share = min(rate * chunks_mean * steady.step, 1.0)
    return share, share * (queue.dispersion + queue.service_cv2)


@dataclass(frozen=True)
class _ShortOutputPasses:
    """What a short output's intervals meet: the chain of prefill passes, the
    measured lift of its first passes carried to this count, and the router's
    exposure both took."""

    chain: PrefillPassChain
    early: EarlyPrefills | None
    exposure: float


def _short_output_passes(
    steady: _SteadyStep,
    queue: _PrefillQueue,
    load: PerReplicaLoad,
    policy: LatencySettings,
    rate: float,
    replicas: int,
) -> _ShortOutputPasses:
    """The prefill passes short outputs meet at ``replicas`` (see :func:`_itl_tail`)."""
    share, variance_per_pass = _prefill_pass_share(steady, queue, rate)
    # Measured at one count, carried to this one (see router_pick).
    exposure = prefill_exposure_at(
        load.prefill_pass_decode_deficit,
        load.measured_replicas,
        replicas,
        steady.batch,
        queue.busy,
        queue.queued_per_busy,
        policy.balanced_routing,
    )
    # A decode's passes carry the prompts its replica is sent, which a balancing
    # router keeps off busy replicas. Where the streams measured what a request's
    # first passes meet (the lift), that is in the lift: measured against the
    # replica's share at large, and carried to this count by the router's pick
    # (_early_prefills_at), so the chain keeps the replica's share. Else the
    # share the decodes meet is the replica's times the exposure, as for long
    # outputs (whose count keeps its variance; the chain's is thinned with its
    # share). Unthinned and without a lift, bursty code held at 22 replicas
    # (exposure 0.14) put the share of 6-11-token outputs that met a prefill at 5x
    # the simulated (docs/planner-history.md, 2026-11-30 eighth); thinned with the
    # lift too, the router's pick entered twice (2026-12-01, fifth).
    early = _early_prefills_at(load, exposure, steady.batch, replicas)
    thinning = 1.0 if early is not None else exposure
    chain = PrefillPassChain.of(min(share * thinning, 1.0), variance_per_pass * thinning)
    return _ShortOutputPasses(chain, early, exposure)


def short_output_prefill_counts(
    predictor: StepTimePredictor,
    load: PerReplicaLoad,
    engine: EngineLimits,
    policy: LatencySettings,
    replicas: int,
    longest: int,
) -> list[npt.NDArray[np.float64]]:
    """For outputs of m = 1..``longest`` intervals, P(K = k), k = 0..m: the prefill
    passes the model has such a request meet at ``replicas`` (entry ``m - 1``), as
    its ITL tail takes them. Empty where it takes none: output lengths not
    measured, or the replica overloaded. For benchmarks that set it against the
    simulated passes (``bench_prediction.py``)."""
    rate, prompt, classes = _prompt_classes(load)
    passes = _Passes(predictor, load.mean_decode_context_tokens, load.mean_cached_tokens)
    steady = _steady_step(passes, load, engine, rate, prompt, classes, replicas)
    if isinstance(steady, LatencyPrediction) or not load.output_intervals:
        return []
    queue = _prefill_queue(passes, steady, load, policy, rate, classes, replicas)
    if isinstance(queue, LatencyPrediction):
        return []
    short = _short_output_passes(steady, queue, load, policy, rate, replicas)
    return short.chain.after_first_token(longest, short.early)


def _early_prefills_at(
    load: PerReplicaLoad, exposure: float, batch: float, replicas: int
) -> EarlyPrefills | None:
    """The measured lift of a request's first passes (see early_prefills), carried
    from the count it was measured at to ``replicas`` (``exposure`` and ``batch``
    are that count's).

    The lift is measured against its replica's share of prefill passes, so it holds
    both the clump a request came with and where the router put the prompts: a
    balancing router keeps them off replicas busy with decodes (the measured
    deficit), and a decode's pass then carries prefill less often than a pass at
    large, the more so as the fleet grows. What a decode meets is the share times
    the decodes a prefill pass carries over those a mean pass carries (a running
    pass carries at least one: ``prefill_exposure``); the lift is carried by the
    ratio of that at ``replicas`` to that at the measured count, and is as measured
    at the measured count itself. Held at one count, the lift carried unchanged
    made the short outputs' p99 ITL almost flat in the count: on bursty code, 11
    replicas predicted from 5 at 1.83x their simulated p99 and 5 from 11 at 0.73x
    (docs/planner-history.md, 2026-11-30 seventh).

    The lift multiplies the chain's share, which :func:`_short_output_passes` keeps
    at the replica's share where a lift is measured: the router's pick enters the
    first passes once, here. (From 2026-11-30 eighth to 2026-12-01 fifth the chain
    was thinned by the exposure as well, which cancelled part of a lift that read
    high on roomy fleets; see early_prefills.) This carry is too flat in the
    count: bursty code held at 5, 6, 8 and 11 predicts 11 from 5 at 1.39x the
    simulated p99 and 5 from 11 at 0.67x, where each count's own load gives
    0.82-0.97x (docs/planner-history.md, 2026-12-01 fifth): a balancing router's
    pick falls with the count faster than the deficit's exposure has it.
    """
    early = load.early_prefills
    measured = load.measured_replicas
    deficit = load.prefill_pass_decode_deficit
    if early is None or measured <= 0 or measured == replicas or batch <= 0.0 or deficit <= 0.0:
        return early
    batch0 = batch * replicas / measured  # the same fleet-wide decodes, split over n0

    def decodes_at_prefill_over_mean_pass(e: float, b: float) -> float:
        return e * b / max(b, 1.0)

    there = decodes_at_prefill_over_mean_pass(prefill_exposure(deficit, batch0), batch0)
    if there <= 0.0:
        return early
    return early.scaled(decodes_at_prefill_over_mean_pass(exposure, batch) / there)


@dataclass(frozen=True)
class _TtftTail:
    """The TTFT a prompt meets: mean, quantile, and the share no count serves in time."""

    quantile_s: float
    mean_s: float
    # Share of prompts whose prefill alone, on an idle replica, exceeds the limit.
    unreachable_share: float
    # Of the others, the share predicted to exceed it (0: no limit asked about).
    miss_share: float


def _ttft_tail(
    passes: _Passes,
    steady: _SteadyStep,
    queue: _PrefillQueue,
    classes: list[tuple[float, float]],
    engine: EngineLimits,
    policy: LatencySettings,
    ttft_limit_ms: float | None,
    ttft_slo_ms: float | None,
) -> _TtftTail:
    """The wait at the router's pick, the prefill service and half a decode pass:
    mean and quantile, the quantile over the prompts a replica can serve in time.

    A prompt is out of reach when its prefill alone, on an idle replica, exceeds
    the SLO itself (``ttft_slo_ms``). One whose prefill alone fits the SLO but not
    the planning limit (``ttft_limit_ms``, the SLO less the margin) is served in
    time only if it hardly waits: it counts as a miss when its TTFT exceeds the
    SLO, every other prompt when its TTFT exceeds the limit. Taking the limit for
    reach gave those prompts up: on the long-context scenario (10 s SLO) 4.1% of
    requests were called out of reach where 2.7% are.
    """
    q_tail = 1.0 - policy.latency_quantile
    f_d, services, service = steady.decode_s, queue.services, queue.service
    p_wait = queue.pick.prefilling
    wait_mean = p_wait * queue.residual + queue.pick.queued * queue.admitted_mean
    ttft_mean = wait_mean + service + f_d / 2.0
    unreachable = 0.0
    reachable = services
    # What each reachable class is judged against: the limit, or the SLO for one
    # whose prefill alone already exceeds the limit.
    judged_at: list[float] = []
    if ttft_limit_ms is not None and len(services) > 1:
        limit_s = ttft_limit_ms / 1e3
        reach_s = max(ttft_slo_ms / 1e3, limit_s) if ttft_slo_ms is not None else limit_s
        alone = [
            passes.prefill(length, engine.max_num_batched_tokens, 0.0) for length, _ in classes
        ]
        idle_floor = passes.decode(0.0)
        alone_s = [n * f + idle_floor for n, f in alone]
        keep = [t <= reach_s for t in alone_s]
        unreachable = sum(p for ok, (_, p) in zip(keep, services, strict=True) if not ok)
        reachable = [sp for ok, sp in zip(keep, services, strict=True) if ok]
        judged_at = [
            limit_s if t <= limit_s else reach_s for t, ok in zip(alone_s, keep, strict=True) if ok
        ]
    exceed: Callable[[float], float] | None
    spread_services: list[tuple[float, float]] = []
    if len(services) > 1:
        mass = sum(p for _, p in reachable)
        if mass > 0.0:
            spread_services = [(t, p / mass) for t, p in reachable]
            exceed = _ttft_exceedance(spread_services, wait_mean, p_wait, f_d)
            start = max(t for t, _ in reachable) + f_d + 2.0 * wait_mean / max(p_wait, 1e-9)
            ttft_q = exceedance_quantile(exceed, 0.0, start, q_tail)
        else:
            exceed = None
            ttft_q = math.inf
    else:
        exceed = _ttft_exceedance(
            [(service * policy.prompt_tail_ratio, 1.0)], wait_mean, p_wait, f_d
        )
        wait_q = (wait_mean / p_wait) * math.log(p_wait / q_tail) if p_wait > q_tail else 0.0
        ttft_q = wait_q + service * policy.prompt_tail_ratio + f_d
    # Of the requests that can meet the SLO, the share predicted to miss it.
    ttft_miss = 0.0
    if ttft_limit_ms is not None:
        if exceed is None:
            ttft_miss = 1.0
        elif spread_services:
            ttft_miss = sum(
                _ttft_exceedance([sp], wait_mean, p_wait, f_d)(at)
                for sp, at in zip(spread_services, judged_at, strict=True)
            )
        else:
            ttft_miss = exceed(ttft_limit_ms / 1e3)
    return _TtftTail(ttft_q, ttft_mean, unreachable, ttft_miss)


def predict_latency(
    predictor: StepTimePredictor,
    load: PerReplicaLoad,
    engine: EngineLimits,
    policy: LatencySettings,
    replicas: int = 1,
    ttft_limit_ms: float | None = None,
    ttft_slo_ms: float | None = None,
    itl_limit_ms: float | None = None,
) -> LatencyPrediction:
    """Steady-state TTFT/ITL of one replica carrying ``load`` (see module docstring).

    With a measured prompt-length distribution (``load.prompt_lengths``) the
    prefill service time is averaged over it (attention grows with the context,
    so the mean prompt's time is too low), its CV^2 is measured rather than
    assumed, and the TTFT quantile is taken over the distribution. Prompts whose
    prefill alone exceeds the SLO (``ttft_slo_ms``; without one, ``ttft_limit_ms``)
    on an idle replica still load it, but the TTFT quantile is over the others (see
    ``unreachable_share``); ``ttft_miss_share`` is the share of those predicted to
    exceed ``ttft_limit_ms`` (the SLO, for a prompt whose prefill alone exceeds it),
    and ``itl_miss_share`` the share of requests predicted over ``itl_limit_ms``.

    In stages: the prompts' classes, the steady step, the prefill queue a prompt
    meets, then the ITL and TTFT tails; an overload stops at the stage it shows in.
    """
    rate, prompt, classes = _prompt_classes(load)
    passes = _Passes(predictor, load.mean_decode_context_tokens, load.mean_cached_tokens)
    steady = _steady_step(passes, load, engine, rate, prompt, classes, replicas)
    if isinstance(steady, LatencyPrediction):
        return steady
    queue = _prefill_queue(passes, steady, load, policy, rate, classes, replicas)
    if isinstance(queue, LatencyPrediction):
        return queue
    itl, exposure = _itl_tail(passes, steady, queue, load, policy, rate, replicas)
    itl_s = itl.quantile(1.0 - policy.latency_quantile)
    ttft = _ttft_tail(passes, steady, queue, classes, engine, policy, ttft_limit_ms, ttft_slo_ms)
    return LatencyPrediction(
        replicas=replicas,
        ttft_ms=ttft.quantile_s * 1e3,
        itl_ms=itl_s * 1e3,
        ttft_mean_ms=ttft.mean_s * 1e3,
        itl_mean_ms=_decode_weighted_step(steady, exposure) * 1e3,
        step_time_ms=steady.step * 1e3,
        decode_batch=steady.batch,
        prefill_utilisation=queue.rho_tokens,
        bottleneck="",
        unreachable_share=ttft.unreachable_share,
        ttft_miss_share=ttft.miss_share,
        itl_miss_share=itl.share_above(itl_limit_ms / 1e3) if itl_limit_ms is not None else 0.0,
        prefill_service_ms=queue.service * 1e3,
        prefill_tokens_per_decode=rate * prompt * steady.step * exposure,
    )


def _decode_weighted_step(steady: _SteadyStep, exposure: float) -> float:
    """The mean pass a decode token is in, seconds: the decode pass plus the
    prefill's extra time at the router's ``exposure``.

    Passes carry prefill for a share ``phi`` of them and take ``step - decode_s``
    longer on average over all passes; a balancing router sends prompts to
    replicas with fewer decodes, so those passes hold ``exposure`` times the mean
    pass's decodes, and a decode token meets the extra time ``exposure`` times as
    often: ``decode_s + exposure * (step - decode_s)``. The step itself is the
    mean over passes, which the measured ITL mean (pass wall times weighted by
    their decodes) is not: with 6k-token prompts on 4-8 replicas the step read
    1.10-1.15x the measured mean, this 0.96-1.01x.
    """
    return steady.decode_s + exposure * max(steady.step - steady.decode_s, 0.0)


def smallest_replicas_within_slo(
    meets: Callable[[int], bool], low: int, high: int
) -> tuple[int, bool]:
    """Smallest n in [low, high] with ``meets(n)``; (high, False) if none does.

    ``meets`` must be monotone (more replicas never hurt), so a binary search is
    enough.
    """
    if high < low:
        return high, False
    if not meets(high):
        return high, False
    lo, hi = low, high
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo, True


def prefill_tokens_per_s(predictor: StepTimePredictor, engine: EngineLimits) -> float:
    """Prompt tokens one replica computes per second when it only prefills."""
    chunk = max(engine.max_num_batched_tokens, 1)
    step = predictor.predict(
        ScheduledRequestMetrics(num_prefill_requests=1, sum_prefill_tokens=chunk)
    )
    return chunk / max(step, 1e-6)
