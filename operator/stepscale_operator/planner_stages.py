"""The typed values the planner's stages hand each other, each with its reason.

A decision is a short sequence of stages (see :meth:`Planner.decide
<stepscale_operator.planner.Planner.decide>`): the fleet as it is, the demand,
the capacity that demand needs, the floors (bursts, the scale-down window, the
spec's bounds), and the verdict. Each stage returns one of these frozen values;
the binding stage's ``reason`` is the decision's reason, and ``record`` gives
what status and logs show of it (the keys ``Decision.inputs`` has always had).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from stepscale_operator.burst_recurrence import RecurringBurst
from stepscale_operator.latency_model import (
    EngineLimits,
    LatencyPrediction,
    SloTargets,
    StepTimePredictor,
)
from stepscale_operator.load_types import LoadEstimate


@dataclass(frozen=True)
class ReplicaCounts:
    """Replicas serving now, and the start times of those still starting."""

    ready: int
    starting_since: tuple[float, ...] = ()


@dataclass(frozen=True)
class PlannerInputs:
    """Everything one decision depends on."""

    predictor: StepTimePredictor
    model_ready: bool
    model_mape: float | None
    load: LoadEstimate | None
    load_time: float | None  # when ``load`` was computed (same clock as ``now``)
    replicas: ReplicaCounts
    slo: SloTargets
    min_replicas: int
    max_replicas: int
    engine: EngineLimits
    pod_startup_s: float
    # The share of the passes sent over the load window that the estimate saw
    # (:class:`~stepscale_operator.ingest_coverage.IngestCoverage`); the rest was
    # shed or lost, so the estimate is a lower bound.
    load_seen_fraction: float = 1.0


@dataclass(frozen=True)
class Decision:
    """One planner decision, explainable from ``inputs``.

    ``desired_replicas`` is what the planner recommends; ``apply`` is False when
    nothing should change (a hold, or advisory mode).
    """

    time: float
    desired_replicas: int
    current_replicas: int  # ready + starting, as the Deployment counts them
    action: str  # "scale_up", "scale_down" or "hold"
    apply: bool
    reason: str
    confidence: float
    # At the ready replicas and at the desired count (less pods stuck starting), both
    # on the load named by ``inputs["predictions_load"]`` ("planned": the forecast
    # a scale-up or hold is judged on; "measured": what a scale-down is judged on).
    # Zero replicas serve nothing: an infeasible "no_replicas" prediction. None when
    # no load was judged (stale data, no cost model, a clamp to the bounds).
    predicted_current: LatencyPrediction | None
    predicted_desired: LatencyPrediction | None
    inputs: dict[str, object] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """JSON-able form for status, events and logs."""
        return asdict(self)


@dataclass(frozen=True)
class FleetNow:
    """Replicas as the Deployment counts them, and the spec's bounds."""

    ready: int
    starting: int
    timed_out: int  # starting for longer than the policy believes
    low: int  # minReplicas
    high: int  # maxReplicas (never below minReplicas)

    @property
    def total(self) -> int:
        """Ready plus starting: what the Deployment's replica count is."""
        return self.ready + self.starting

    @property
    def coming(self) -> int:
        """Capacity that is serving or will be (pods stuck starting excluded)."""
        return self.total - self.timed_out

    def record(self) -> dict[str, object]:
        """Status/log fields."""
        return {
            "ready": self.ready,
            "starting": self.starting,
            "starting_timed_out": self.timed_out,
        }


@dataclass(frozen=True)
class Demand:
    """What the fleet must carry: measured, corrected by the queue, and looked ahead."""

    measured: LoadEstimate  # served load times ``demand_ratio`` (arrivals by mass balance)
    planned: LoadEstimate  # ``measured`` one horizon ahead (trend, headroom)
    survivors: LoadEstimate  # ``measured`` at the heavier request mix (scale-down judges it)
    horizon_s: float
    demand_ratio: float
    backlog_replicas: int  # replicas that drain the queue, when it is a backlog now
    backlog_drain_replicas: int  # the same, whether or not it is a backlog now
    backlog_free_at: int  # the fewest serving replicas for which the queue is no backlog
    queued_prefill_tokens: float
    queue_growth_tokens_per_s: float
    forecast_ratio: float
    long_trend_ratio: float | None
    headroom_ratio: float  # the least forecast ratio at this horizon
    mix_ratio: float | None
    reason: str

    @property
    def idle(self) -> bool:
        """Nothing to serve at all."""
        return self.planned.prefill_tokens_per_s <= 0.0 and self.planned.decode_tokens_per_s <= 0.0

    def record(self) -> dict[str, object]:
        """Status/log fields."""
        return {
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "queue_growth_tokens_per_s": self.queue_growth_tokens_per_s,
            "demand_ratio": self.demand_ratio,
            "backlog_replicas": self.backlog_replicas,
            "backlog_free_at": self.backlog_free_at,
            "long_trend_ratio": self.long_trend_ratio,
            "forecast_ratio": self.forecast_ratio,
            "headroom_ratio": self.headroom_ratio,
            "mix_ratio": self.mix_ratio,
            "planned_load": self.planned.to_dict(),
            "lookahead_s": self.horizon_s,
        }


@dataclass(frozen=True)
class CapacityNeed:
    """Replicas the model says the demand needs, at the margin the model's error allows."""

    needed: int  # the planned load within the SLO less ``margin``
    reachable: bool  # False: no count up to the search bound meets it
    down_ok: int  # the survivors' load within the SLO less margin plus hysteresis
    measured_need: int  # the measured demand with headroom, no trend (bursts judge it)
    margin: float
    search_high: int
    unreachable_share: float  # of requests no replica count serves within the SLO
    reason: str
    caveat: str  # what of the SLO is out of reach and what was planned instead ("": none)

    def record(self) -> dict[str, object]:
        """Status/log fields."""
        return {
            "effective_margin": self.margin,
            "capacity_reachable": self.reachable,
            "unreachable_share": self.unreachable_share,
        }


@dataclass(frozen=True)
class BurstFloor:
    """The floor bursts ask for, and the recurring burst it prepares for (if so)."""

    floor: int
    prepared: RecurringBurst | None
    seen_s_ago: float | None
    # The latest burst's demand faded over longer than a start-up this long ago, and
    # its peak is no longer kept (None: not faded, or no burst).
    faded_s_ago: float | None
    # The latest burst was seen from its end: a level whose arrivals stopped within a
    # start-up, with no onset seen (kept like a burst's peak).
    seen_leaving: bool
    onsets: tuple[tuple[float, int], ...]
    recurring: RecurringBurst | None
    reason: str

    def record(self) -> dict[str, object]:
        """Status/log fields (what ``status.bursts`` reads)."""
        return {
            "burst_seen_s_ago": self.seen_s_ago,
            "burst_faded_s_ago": self.faded_s_ago,
            "burst_seen_leaving": self.seen_leaving,
            "recurring_burst": asdict(self.recurring) if self.recurring is not None else None,
            "burst_onsets": [[onset, peak] for onset, peak in self.onsets],
        }


@dataclass(frozen=True)
class Floors:
    """The need with every floor applied: backlog, bursts, pods stuck starting, bounds."""

    needed: int  # what scale-up aims for (need + backlog, or a due burst's peak)
    for_burst: bool  # a recurring burst due within a start-up set ``needed``
    for_measured_miss: bool  # a sustained measured miss set ``needed``
    scale_down_floor: int  # fewest replicas scale-down may leave
    for_backlog: bool  # the queued backlog set ``scale_down_floor``
    measured_floor: int  # what the stabilization window remembers
    load_floor: int  # the floor without the burst memory (to tell which one binds)

    def record(self) -> dict[str, object]:
        """Status/log fields."""
        return {
            "needed_replicas": self.needed,
            "scale_down_floor": self.scale_down_floor,
            "measured_floor": self.measured_floor,
        }


@dataclass(frozen=True)
class Verdict:
    """The decision's count, why, and which load its predictions are on."""

    desired: int
    reason: str
    basis: str  # "planned" or "measured": the load the reported predictions use
    serving_after: int  # replicas that will serve at ``desired`` (stuck pods excluded)
    # A scale-up within the stabilization window of the last scale-down undoes it:
    # how long ago that scale-down was (None: not such a scale-up).
    undoes_scale_down_s_ago: float | None = None
