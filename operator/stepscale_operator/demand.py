"""The demand stage: what the fleet must carry now and one pod start-up ahead.

The load estimate measures *served* work. Once the queued prefill tokens exceed a
share of the TTFT budget per replica, the fleet is behind: the demand is the served
load plus the queue's growth over the same window (less its shrinking while a
backlog drains, when the served rate overstates the arrivals and its rise is not
extrapolated), and the replicas that drain the queue within one start-up time are
added. The look-ahead raises the planned load only as far as the trend persisted
over the last few decisions and as far as the demand's slope over the last two
minutes supports it, capped; and never below a headroom that grows with the pod
start-up as far as the demand's own rises grew with it (``lookahead_headroom``).
Scale-down judges the survivors on the measured request rate at the heavier of its
own request mix and the mean mix over ``mix_memory_s``.

Pure and deterministic: the only state is the recent history these rules need.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from stepscale_operator.latency_model import prefill_tokens_per_s
from stepscale_operator.load_types import LoadEstimate, bin_tokens_or_centres, prompt_bin_centers
from stepscale_operator.lookahead_headroom import lookahead_headroom
from stepscale_operator.planner_policy import PlannerPolicy
from stepscale_operator.planner_stages import Demand, PlannerInputs


def forecast_load(load: LoadEstimate, horizon_s: float, max_ratio: float) -> LoadEstimate:
    """The load expected ``horizon_s`` ahead from its trend; never below today's load.

    A falling trend is ignored: the planner never removes capacity on a forecast,
    only on what it measured.
    """
    horizon = max(horizon_s, 0.0)

    def ahead(rate: float, trend: float) -> float:
        if rate <= 0.0:
            return max(trend, 0.0) * horizon
        return min(rate + max(trend, 0.0) * horizon, rate * max_ratio)

    prefill = ahead(load.prefill_tokens_per_s, load.prefill_tokens_per_s_trend)
    decode = ahead(load.decode_tokens_per_s, load.decode_tokens_per_s_trend)
    ratio = prefill / load.prefill_tokens_per_s if load.prefill_tokens_per_s > 0.0 else 1.0
    requests = load.prefill_requests_per_s * ratio
    if requests <= 0.0 and prefill > 0.0:
        requests = prefill / max(load.mean_prompt_tokens, 1.0)
    return replace(
        load,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        prefill_requests_per_s=requests,
        prefill_cached_tokens_per_s=load.prefill_cached_tokens_per_s * ratio,
    )


def with_demand(load: LoadEstimate, ratio: float) -> LoadEstimate:
    """``load`` with its request and token rates multiplied by ``ratio``."""
    if ratio == 1.0:
        return load
    return replace(
        load,
        prefill_tokens_per_s=load.prefill_tokens_per_s * ratio,
        prefill_requests_per_s=load.prefill_requests_per_s * ratio,
        prefill_cached_tokens_per_s=load.prefill_cached_tokens_per_s * ratio,
        decode_tokens_per_s=load.decode_tokens_per_s * ratio,
    )


# What the streams measure of the serving fleet rather than of the demand: how the
# router splits the arrivals over the replicas, what a prefill pass spares of their
# decodes, the prefill passes a request meets right after its first token, and the
# streams these were measured on (the model carries them from there to any count).
FLEET_MEASURED_FIELDS = (
    "replica_arrival_dispersion",
    "prefill_pass_decode_deficit",
    "early_prefills",
    "streams_total",
    "streams_missing",
    "missing_streams",
)


def with_fleet_of(demand: LoadEstimate, fleet: LoadEstimate) -> LoadEstimate:
    """``demand`` (arrivals, prompts, outputs) served as ``fleet``'s streams measure
    the serving: its :data:`FLEET_MEASURED_FIELDS` taken from ``fleet``."""
    fields = {name: getattr(fleet, name) for name in FLEET_MEASURED_FIELDS}
    if all(getattr(demand, name) == value for name, value in fields.items()):
        return demand  # measured on the same serving: the estimate itself
    measured = set(FLEET_MEASURED_FIELDS)
    unavailable = (demand.unavailable - measured) | (fleet.unavailable & measured)
    return replace(demand, unavailable=frozenset(unavailable), **fields)


@dataclass(frozen=True)
class _Backlog:
    ratio: float  # arrivals over served (the demand ratio)
    extra: int  # replicas that drain the queue within the drain time (0: no backlog)
    drain: int  # the same, whether or not the queue is a backlog at this fleet's size
    free_at: int  # the fewest serving replicas for which the queue is no backlog
    queued: float  # queued prefill tokens now
    growth: float  # their change per second over the window


def settled_mean(
    window_mean: float, usual_mean: float, histogram: Sequence[float], prompts: float
) -> float:
    """The window's mean prompt length, shrunk towards the usual one by its sampling noise.

    A window of ``prompts`` prompts drawn from the lengths ``histogram`` describes has
    a mean whose variance is the lengths' variance over ``prompts``. A difference
    from ``usual_mean`` of about that size is noise and is shrunk away (James-Stein:
    by the share the noise explains); a larger one is kept almost whole. Heavy
    tails with few prompts per window (long context: about 36 prompts of lognormal
    sigma 1.2) swing the window's mean by a third, and the need with it; a busy
    trace's thousands of prompts per window keep the window's mean.
    """
    total = sum(histogram)
    gap = window_mean - usual_mean
    if prompts <= 0.0 or total <= 0.0 or window_mean <= 0.0 or gap == 0.0:
        return window_mean
    centers = prompt_bin_centers()
    mean = sum(c * h for c, h in zip(centers, histogram, strict=False)) / total
    variance = sum(h * (c - mean) ** 2 for c, h in zip(centers, histogram, strict=False)) / total
    kept = max(0.0, 1.0 - variance / prompts / gap**2)
    return usual_mean + gap * kept


def _until_capacity_s(inputs: PlannerInputs, now: float, starting_timeout_s: float) -> float:
    """Seconds until added capacity serves: the first starting pod's remaining
    start-up, or a whole one when none is starting (the pods this decision adds).
    A pod starting for longer than ``starting_timeout_s`` is not coming, as the
    planner counts it elsewhere."""
    startup = max(inputs.pod_startup_s, 0.0)
    remaining = [
        startup - (now - began)
        for began in inputs.replicas.starting_since
        if now - began <= starting_timeout_s
    ]
    return max(min(remaining), 0.0) if remaining else startup


class DemandStage:
    """Turns each decision's load estimate into a :class:`Demand`, keeping the short
    histories the look-ahead and the mix memory need."""

    def __init__(self, policy: PlannerPolicy) -> None:
        self.policy = policy
        # (time, measured demand rate) of every decision, for the long trend and the
        # headroom: over the longer of ``trend_history_s`` and ``headroom_history_s``
        self._demand_history: list[tuple[float, float]] = []
        self._ratios: list[tuple[float, float]] = []  # (time, raw forecast ratio)
        # (time, prefill tokens per request), for the mix memory
        self._mix: list[tuple[float, float]] = []
        # (time, prompt histogram, prompt tokens per bin, mean prompt), for the usual shape
        self._shapes: list[tuple[float, tuple[float, ...], tuple[float, ...], float]] = []

    def demand(self, inputs: PlannerInputs, now: float) -> Demand:
        """The served load corrected by the queue's growth, and the load one horizon ahead."""
        policy = self.policy
        assert inputs.load is not None
        horizon = policy.lookahead_horizon_s(inputs.pod_startup_s)
        backlog = self._backlog(inputs, now)
        measured = with_demand(self._with_usual_shape(inputs.load, now), backlog.ratio)
        if backlog.ratio < 1.0:
            # Draining a backlog: the served rate rises as the queue empties, and
            # that rise is the drain, not arrivals; it must not be extrapolated.
            measured = replace(
                measured,
                prefill_tokens_per_s_trend=min(measured.prefill_tokens_per_s_trend, 0.0),
                decode_tokens_per_s_trend=min(measured.decode_tokens_per_s_trend, 0.0),
            )
        self._record_demand(measured, now)
        headroom = self._headroom(horizon, now)
        planned, forecast_ratio, long_ratio = self._persistent_forecast(
            measured, horizon, headroom, now
        )
        survivors, mix_ratio = self._with_heavier_mix(measured, now)
        reason = f"the load {horizon:.0f}s ahead"
        if headroom > max(policy.min_lookahead_ratio, 1.0):
            reason += f" (at least {headroom:.2f}x today's, as it rose over {horizon:.0f}s)"
        return Demand(
            measured=measured,
            planned=planned,
            survivors=survivors,
            horizon_s=horizon,
            demand_ratio=backlog.ratio,
            backlog_replicas=backlog.extra,
            backlog_drain_replicas=backlog.drain,
            backlog_free_at=backlog.free_at,
            queued_prefill_tokens=backlog.queued,
            queue_growth_tokens_per_s=backlog.growth,
            forecast_ratio=forecast_ratio,
            long_trend_ratio=long_ratio,
            headroom_ratio=headroom,
            mix_ratio=mix_ratio,
            reason=reason,
        )

    def _record_demand(self, measured: LoadEstimate, now: float) -> None:
        """Keep this decision's measured demand rate for the long trend and the headroom."""
        policy = self.policy
        rate = measured.prefill_tokens_per_s or measured.decode_tokens_per_s
        kept = max(policy.trend_history_s, policy.headroom_history_s)
        self._demand_history.append((now, rate))
        self._demand_history = [d for d in self._demand_history if d[0] >= now - kept]

    def _headroom(self, horizon: float, now: float) -> float:
        """The least ratio the load is planned at over the measured one (see
        :func:`lookahead_headroom`), from the measured demand's own history."""
        policy = self.policy
        since = now - policy.headroom_history_s
        return lookahead_headroom(
            [d for d in self._demand_history if d[0] >= since],
            horizon,
            policy.headroom_reference_horizon_s,
            policy.min_lookahead_ratio,
            policy.max_forecast_ratio,
            policy.headroom_rise_quantile,
            policy.headroom_min_pairs,
        )

    def _persistent_forecast(
        self, measured: LoadEstimate, horizon: float, floor: float, now: float
    ) -> tuple[LoadEstimate, float, float | None]:
        """The trend forecast, raised only as far as it held over the persistence window
        and never below ``floor``; with the ratio it raised the load by and the long
        trend's bound.

        A trend fitted on a 30 s window is noisy; one that persists for a few
        decisions is a ramp. Fast up (a persistent rise is followed at once),
        never down on a forecast (see :func:`forecast_load`).
        """
        policy = self.policy
        ahead = forecast_load(measured, horizon * policy.trend_weight, policy.max_forecast_ratio)
        base = measured.prefill_tokens_per_s or measured.decode_tokens_per_s
        raised = ahead.prefill_tokens_per_s or ahead.decode_tokens_per_s
        ratio = raised / base if base > 0.0 else 1.0
        self._ratios.append((now, ratio))
        self._ratios = [r for r in self._ratios if r[0] >= now - policy.trend_persistence_s]
        held = min(r for _, r in self._ratios)
        long_ratio = self._long_trend_ratio(base, horizon, now)
        if long_ratio is not None:
            held = min(held, long_ratio)
        forecast_ratio = max(held, floor)
        if held >= ratio and ratio >= floor:
            return ahead, forecast_ratio, long_ratio
        return with_demand(measured, forecast_ratio), forecast_ratio, long_ratio

    def _with_heavier_mix(
        self, load: LoadEstimate, now: float
    ) -> tuple[LoadEstimate, float | None]:
        """``load`` at its request rate, with the heavier of its own prompt length and
        the mean prompt length over ``mix_memory_s``; and that ratio (None: no memory).

        Only scale-down is judged on it: prompts shorter than usual let the fleet
        shrink, and the usual ones coming back at the same request rate is a rise
        faster than pods start. The mean, not the peak, of the history: one window's
        heavy prompts are noise, the usual mix is what returns. The output side is
        not remembered: generated tokens per request also fall when a fleet's
        decode load falls at a steady prompt rate, which is a real drop in load.
        """
        window = self.policy.mix_memory_s
        rate = load.prefill_requests_per_s
        if window <= 0.0 or rate <= 0.0:
            return load, None
        prefill_each = load.prefill_tokens_per_s / rate
        self._mix.append((now, prefill_each))
        self._mix = [m for m in self._mix if m[0] >= now - window]
        usual_prefill = sum(m[1] for m in self._mix) / len(self._mix)
        ratio = max(usual_prefill / prefill_each, 1.0) if prefill_each > 0.0 else 1.0
        if ratio == 1.0:
            return load, ratio
        return (
            replace(
                load,
                prefill_tokens_per_s=load.prefill_tokens_per_s * ratio,
                prefill_cached_tokens_per_s=load.prefill_cached_tokens_per_s * ratio,
                mean_prompt_tokens=load.mean_prompt_tokens * ratio,
                # The decode context is mostly the prompt: it scales with it.
                mean_decode_context_tokens=load.mean_decode_context_tokens * ratio,
            ),
            ratio,
        )

    def _with_usual_shape(self, load: LoadEstimate, now: float) -> LoadEstimate:
        """``load`` with its prompt-length histogram pooled over ``mix_memory_s``.

        Rates change within seconds, the shape of the prompt lengths slowly; one
        window holds few prompts of the tail (at one long prompt a second, a 30 s
        window has 30), so its tail share swings with every long prompt and the
        need with it. Pooled over the mix memory, the tail is the traffic's.
        """
        window = self.policy.mix_memory_s
        if window <= 0.0 or not load.prompt_histogram or load.mean_prompt_tokens <= 0.0:
            return load
        tokens = bin_tokens_or_centres(load.prompt_histogram, load.prompt_bin_tokens)
        self._shapes.append((now, load.prompt_histogram, tokens, load.mean_prompt_tokens))
        self._shapes = [h for h in self._shapes if h[0] >= now - window]
        pooled = tuple(sum(c) for c in zip(*(h for _, h, _, _ in self._shapes), strict=True))
        pooled_tokens = tuple(sum(c) for c in zip(*(t for _, _, t, _ in self._shapes), strict=True))
        # The shape, and the window's mean prompt only as far as it differs from the
        # usual one by more than its own sampling noise (pooling the mean outright
        # cost the shared trace 1.5 points of attainment: the usual mean lags the
        # window's mix). The request rate stays the window's.
        usual = sum(m for _, _, _, m in self._shapes) / len(self._shapes)
        prompts = load.prefill_requests_per_s * load.window_s
        mean = settled_mean(load.mean_prompt_tokens, usual, pooled, prompts)
        ratio = mean / load.mean_prompt_tokens
        return replace(
            load,
            prompt_histogram=pooled,
            prompt_bin_tokens=pooled_tokens,
            prefill_tokens_per_s=load.prefill_tokens_per_s * ratio,
            prefill_cached_tokens_per_s=load.prefill_cached_tokens_per_s * ratio,
            mean_prompt_tokens=mean,
        )

    def _long_trend_ratio(self, rate: float, horizon: float, now: float) -> float | None:
        """How far the measured demand's slope over ``trend_history_s`` raises it by
        ``horizon`` (>= 1); None until half that history is known.

        The 30 s window's slope of a busy trace is mostly noise, and noise can hold
        for the persistence window; a real ramp shows over minutes too. On the Azure
        trace this bound cut GPU-hours by 10% at the same attainment.
        """
        span = self.policy.trend_history_s
        if span <= 0.0 or rate <= 0.0:
            return None
        # The positive readings over the span (this decision's is the newest).
        recent = [d for d in self._demand_history if d[0] >= now - span and d[1] > 0.0]
        if now - recent[0][0] < 0.5 * span or len(recent) < 3:
            return None
        times = [t for t, _ in recent]
        rates = [r for _, r in recent]
        mean_t, mean_r = sum(times) / len(times), sum(rates) / len(rates)
        spread = sum((t - mean_t) ** 2 for t in times)
        slope = sum((t - mean_t) * (r - mean_r) for t, r in zip(times, rates, strict=True)) / spread
        return 1.0 + max(slope, 0.0) * horizon / rate

    def _backlog(self, inputs: PlannerInputs, now: float) -> _Backlog:
        """Demand ratio (arrivals over served) and replicas to drain the queue.

        Mass balance over the load estimate's window: arrivals = served + the
        queue's growth, both measured over the same window (the estimator's
        end-to-end queue change). A growing queue means the fleet is behind; a
        shrinking one means it is draining a backlog, and serves more than arrives.
        While the fleet is behind, the queue to drain is the one the coming
        capacity meets: today's, grown at today's rate until the first pod
        starting (or one this decision adds) serves.
        """
        policy = self.policy
        load = inputs.load
        assert load is not None
        queued = max(load.queued_prefill_tokens, 0.0)
        recent = max(queued, load.queued_prefill_tokens_mean)
        growth = load.queued_prefill_tokens_change_per_s
        served = max(load.prefill_tokens_per_s, 0.0)
        per_replica = prefill_tokens_per_s(inputs.predictor, inputs.engine)
        ready = max(inputs.replicas.ready, 1)
        # The queue is a backlog when it holds more than backlog_trigger of an SLO's
        # prefill work per serving replica and more prompts wait than replicas serve
        # (one long prompt waiting is not a backlog of arrivals: each replica takes
        # one at a time). Both bounds grow with the fleet: ``free_at`` is the fewest
        # serving replicas for which this queue is none, which scale-down keeps.
        per_ready = policy.backlog_trigger * inputs.slo.ttft_ms / 1e3 * per_replica
        waiting = max(load.queued_prefill_requests, load.queued_prefill_requests_mean)
        free_at = math.ceil(waiting)
        if per_ready > 0.0:
            free_at = min(free_at, math.ceil(queued / per_ready))
        ratio = 1.0
        met = queued  # the queue the coming capacity meets
        # Only a queue (now or of late) past the trigger means the fleet is or was
        # behind; below it, queue changes are the noise of normal batching.
        if waiting > ready and recent > per_ready * ready and served > 0.0:
            ratio = (served + growth) / served
            # A step in the arrivals shows in the newest seconds' balance long before
            # the window's: react to it (rises only; a drain is judged on the window).
            ratio = max(ratio, load.prefill_demand_tokens_per_s_recent / served)
            ratio = min(max(ratio, 1.0 / policy.max_demand_ratio), policy.max_demand_ratio)
            # Sized on today's queue, the drain replicas arrive to a queue a
            # start-up's growth larger (bursts: 1 replica asked for where 2 drain
            # what the first pods meet; attainment 92.75% -> 93.89% at the same
            # GPU-hours).
            growing = max(growth, load.prefill_demand_tokens_per_s_recent - served, 0.0)
            met = queued + growing * _until_capacity_s(inputs, now, policy.starting_timeout_s)
        drain_s = policy.backlog_drain_s or max(inputs.pod_startup_s, 1.0)
        drain = 0
        if met > 0.0 and per_replica > 0.0:
            drain = min(math.ceil(met / (per_replica * drain_s)), policy.max_surge)
        # A backlog now is one at the serving count: fewer serve than ``free_at``.
        extra = drain if ready < free_at else 0
        return _Backlog(ratio, extra, drain, free_at, queued, growth)
