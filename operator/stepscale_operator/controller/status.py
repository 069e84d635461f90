"""The ``VllmDeployment`` status, built from the core's state (pure).

Every field written here is declared in the CRD's status schema (a real API
server prunes undeclared fields; ``tests/operator/test_status_and_crd.py`` checks that
nothing would be pruned). The result is a JSON merge patch: ``None`` inside an
object clears a field that no longer applies (e.g. predictions while holding on
missing data); list items never hold ``None``.

Conditions follow the Kubernetes convention (``type``, ``status``, ``reason``,
``message``, ``lastTransitionTime``, ``observedGeneration``); the transition time
only moves when the status of a condition changes.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from stepscale_operator.controller.discovery import parse_timestamp
from stepscale_operator.latency_model import LatencyPrediction
from stepscale_operator.load_types import LoadEstimate
from stepscale_operator.planner import Decision

if TYPE_CHECKING:  # the autoscaler pulls in sockets; the status only reads its result
    from stepscale_operator.controller.autoscaler import DecisionRound

CONDITION_TYPES = ("MetricsFresh", "ModelReady", "ScalingActive", "Degraded")
CHECKPOINT_KEY = "checkpoint"
# Lists of stream names in status are capped in count and name length, so the
# object stays small whatever identities arrive (the API server refuses ~1.5 MiB).
MAX_LISTED_STREAMS = 32
MAX_STREAM_NAME = 128


def stream_names(names: Sequence[str]) -> list[str]:
    """At most :data:`MAX_LISTED_STREAMS` names, each cut to :data:`MAX_STREAM_NAME`
    characters (a cut name ends in ``...``); the counts next to the list stay exact."""
    return [
        n if len(n) <= MAX_STREAM_NAME else n[: MAX_STREAM_NAME - 3] + "..."
        for n in names[:MAX_LISTED_STREAMS]
    ]


def rfc3339(wall_s: float) -> str:
    """``2026-01-02T03:04:05Z`` for seconds since the epoch."""
    return datetime.datetime.fromtimestamp(wall_s, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def finite(value: object, digits: int = 6) -> float | None:
    """A rounded finite float, or None for NaN/inf/None/non-numbers."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    f = float(value)
    return round(f, digits) if math.isfinite(f) else None


def json_clean(value: Any) -> Any:
    """Non-finite floats to None; list items lose their None fields (objects keep them)."""
    if isinstance(value, Mapping):
        return {str(k): json_clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_drop_none(json_clean(v)) for v in value if v is not None]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    return value


def condition(
    ctype: str,
    ok: bool,
    reason: str,
    message: str,
    now_wall: float,
    generation: int | None,
    previous: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """One condition; keeps the previous ``lastTransitionTime`` when the status did not change."""
    status = "True" if ok else "False"
    since = rfc3339(now_wall)
    for old in previous:
        if (
            old.get("type") == ctype
            and old.get("status") == status
            and old.get("lastTransitionTime")
        ):
            since = str(old["lastTransitionTime"])
    cond: dict[str, Any] = {
        "type": ctype,
        "status": status,
        "reason": reason,
        "message": message[:1024],
        "lastTransitionTime": since,
    }
    if generation is not None:
        cond["observedGeneration"] = generation
    return cond


# The cost model's regime cells as status spells them.
_RECENT_FACTOR_NAMES = {"small_decode": "smallDecode"}


def cost_model_status(snapshot: Mapping[str, Any]) -> dict[str, Any]:
    """``status.costModel`` from :meth:`CostModel.to_dict`, which is kept as the checkpoint."""
    quality = snapshot.get("quality") or {}
    regimes = snapshot.get("regime_samples") or {}
    mape = finite(quality.get("mape"))
    updated = snapshot.get("updated_at")
    return {
        "ready": bool(snapshot.get("ready", False)),
        "formula": str(snapshot.get("formula", "")),
        "coefficients": [
            {
                "name": c.get("name"),
                "unit": c.get("unit"),
                "featureUnit": c.get("feature_unit"),
                "value": finite(c.get("value"), 12),
                "stdError": finite(c.get("std_error"), 12),
            }
            for c in snapshot.get("coefficients", [])
        ],
        "r2": finite(quality.get("r2")),
        "mape": mape,
        "mapePercent": None if mape is None else round(100.0 * mape, 2),
        "medianApe": finite(quality.get("median_ape")),
        "p90Ape": finite(quality.get("p90_ape")),
        "window": quality.get("window"),
        "samples": int(snapshot.get("samples", 0) or 0),
        "effectiveSamples": finite(quality.get("effective_samples"), 2),
        "regimeSamples": {
            "prefillOnly": int(regimes.get("prefill_only", 0)),
            "decodeOnly": int(regimes.get("decode_only", 0)),
            "mixed": int(regimes.get("mixed", 0)),
        },
        "outliersRejected": quality.get("outliers_rejected"),
        "medianSignedError": finite(quality.get("median_signed_error")),
        "quarantinedStreams": {
            str(k): round(float(v), 4)
            for k, v in (quality.get("quarantined") or {}).items()
            if isinstance(v, int | float) and math.isfinite(v)
        },
        "misfitBuckets": {
            str(k): round(float(v), 4)
            for k, v in (quality.get("misfit") or {}).items()
            if isinstance(v, int | float) and math.isfinite(v)
        },
        "recentFactors": {
            _RECENT_FACTOR_NAMES.get(str(k), str(k)): round(float(v), 4)
            for k, v in (quality.get("recent_factors") or {}).items()
            if isinstance(v, int | float) and math.isfinite(v)
        },
        "updatedAt": rfc3339(float(updated)) if isinstance(updated, int | float) else None,
        CHECKPOINT_KEY: json_clean(dict(snapshot)),
    }


_LOAD_FIELDS = {
    "window_s": "windowSeconds",
    "streams_total": "streamsTotal",
    "streams_missing": "streamsMissing",
    "complete": "complete",
    "prefill_tokens_per_s": "prefillTokensPerSecond",
    "prefill_cached_tokens_per_s": "prefillCachedTokensPerSecond",
    "prefill_requests_per_s": "prefillRequestsPerSecond",
    "decode_tokens_per_s": "decodeTokensPerSecond",
    "mean_prompt_tokens": "meanPromptTokens",
    "mean_decode_context_tokens": "meanDecodeContextTokens",
    "prefix_cache_hit_fraction": "prefixCacheHitFraction",
    "queued_prefill_requests": "queuedPrefillRequests",
    "queued_prefill_tokens": "queuedPrefillTokens",
    "queued_decode_requests": "queuedDecodeRequests",
    "prefill_tokens_per_s_trend": "prefillTokensPerSecondTrend",
    "decode_tokens_per_s_trend": "decodeTokensPerSecondTrend",
    "busy_fraction": "busyFraction",
    "queued_prefill_requests_mean": "queuedPrefillRequestsMean",
    "queued_prefill_tokens_mean": "queuedPrefillTokensMean",
    "queued_decode_requests_mean": "queuedDecodeRequestsMean",
    "queued_prefill_tokens_trend": "queuedPrefillTokensTrend",
    "queued_prefill_tokens_change_per_s": "queuedPrefillTokensChangePerSecond",
    "prefill_demand_tokens_per_s_recent": "prefillDemandTokensPerSecondRecent",
    "queued_decode_requests_trend": "queuedDecodeRequestsTrend",
    "missing_streams": "missingStreams",
    "arrival_dispersion": "arrivalDispersion",
    "replica_arrival_dispersion": "replicaArrivalDispersion",
    "prefill_pass_decode_deficit": "prefillPassDecodeDeficit",
    # Per span of 1, 2, 4, 8, 16, 32 passes after a prompt's first token: how much
    # more often they carry prefill than its replica's passes at large.
    "early_prefills": "earlyPrefillLift",
}


def load_status(load: LoadEstimate | None) -> dict[str, Any] | None:
    """``status.load`` (camelCase, rounded)."""
    if load is None:
        return None
    out: dict[str, Any] = {}
    for key, value in load.to_dict().items():
        name = _LOAD_FIELDS.get(key)
        if name is None:
            continue
        if name == "missingStreams" and isinstance(value, list):
            out[name] = stream_names([str(v) for v in value])
        elif name == "earlyPrefillLift" and isinstance(value, list):
            out[name] = [finite(float(v), 3) for v in value]
        elif isinstance(value, bool | int | list):
            out[name] = value
        else:
            out[name] = finite(value, 3)  # None stays None: not measurable, not zero
    return out


def prediction_status(pred: LatencyPrediction | None) -> dict[str, Any] | None:
    """One prediction; latencies are None (absent) when the replicas would be overloaded."""
    if pred is None:
        return None
    return {
        "replicas": pred.replicas,
        "ttftMs": finite(pred.ttft_ms, 2),
        "itlMs": finite(pred.itl_ms, 3),
        "ttftMeanMs": finite(pred.ttft_mean_ms, 2),
        "itlMeanMs": finite(pred.itl_mean_ms, 3),
        "stepTimeMs": finite(pred.step_time_ms, 3),
        "decodeBatch": finite(pred.decode_batch, 2),
        "prefillUtilisation": finite(pred.prefill_utilisation, 4),
        "bottleneck": pred.bottleneck,
    }


def measured_status(decision: Decision | None) -> dict[str, Any] | None:
    """``status.predictions.measured``: the latency the fleet realized (from FPM), beside
    the predictions, and the model's learned correction; None before the model judged."""
    if decision is None or "itl_correction" not in decision.inputs:
        return None
    inputs = decision.inputs
    return {
        "ttftMs": finite(inputs.get("measured_ttft_ms"), 2),
        "itlMs": finite(inputs.get("measured_itl_ms"), 3),
        "ttftMeanMs": finite(inputs.get("measured_ttft_mean_ms"), 2),
        "itlMeanMs": finite(inputs.get("measured_itl_mean_ms"), 3),
        "ttftCorrection": finite(inputs.get("ttft_correction"), 4),
        "itlCorrection": finite(inputs.get("itl_correction"), 4),
        "missSeconds": finite(inputs.get("measured_miss_s"), 1),
    }


def reachability_condition(
    decision: Decision,
    now_wall: float,
    generation: int | None,
    previous: Sequence[Mapping[str, Any]],
) -> dict[str, Any] | None:
    """``SloReachable``: False, with the share, when part of the traffic cannot meet the
    SLO at any replica count (the planner plans for the rest); None when the decision
    did not judge the load on the model."""
    share = decision.inputs.get("unreachable_share")
    if not isinstance(share, int | float):
        return None
    out_of_reach = "out of reach at any count" in decision.reason
    if share > 0.0 or out_of_reach:
        message = (
            f"{share:.1%} of requests cannot meet the TTFT SLO at any replica count; "
            if share > 0.0
            else ""
        ) + "planned for the part that can"
        reason = "PartlyOutOfReach" if share > 0.0 else "OutOfReachAtAnyCount"
        return condition("SloReachable", False, reason, message, now_wall, generation, previous)
    return condition(
        "SloReachable",
        True,
        "Reachable",
        "every request can meet the SLO",
        now_wall,
        generation,
        previous,
    )


def decision_status(decision: Decision, wall_s: float, applied: bool) -> dict[str, Any]:
    """``status.lastDecision``: time, from, to, action, whether applied, reason, confidence."""
    return {
        "time": rfc3339(wall_s),
        "action": decision.action,
        "from": decision.current_replicas,
        "to": decision.desired_replicas,
        "applied": applied,
        "reason": decision.reason[:1024],
        "confidence": finite(decision.confidence, 4),
    }


def burst_status(decision: Decision, wall_s: float) -> dict[str, Any] | None:
    """``status.bursts`` from a decision made on the model (at wall-clock ``wall_s``):
    the last burst faster than pod start-up (and when its demand faded, if it did: its
    peak is then no longer kept; whether it was seen only from its end), the recent
    bursts' onsets (what a restarted operator learns the period from again) and, when
    bursts recur at a period, the next one; None if none seen."""
    inputs = decision.inputs
    seen = inputs.get("burst_seen_s_ago")
    onsets = inputs.get("burst_onsets")
    # Onsets restored from a previous operator count even before this one sees a
    # burst: dropping them from status would lose them at the next restart.
    if not isinstance(seen, int | float) and not onsets:
        return None
    out: dict[str, Any] = {
        "lastSeenSecondsAgo": finite(seen, 1) if isinstance(seen, int | float) else None
    }
    faded = inputs.get("burst_faded_s_ago")
    if isinstance(faded, int | float):
        out["fadedSecondsAgo"] = finite(faded, 1)
    if inputs.get("burst_seen_leaving") is True:
        out["seenLeaving"] = True
    if isinstance(onsets, list) and onsets:
        # The planner's clock is monotonic; status keeps wall-clock times.
        out["recent"] = [
            {"onset": rfc3339(wall_s - (decision.time - float(t))), "peakNeed": int(peak)}
            for t, peak in onsets
        ]
    recurring = inputs.get("recurring_burst")  # a RecurringBurst as a dict
    if isinstance(recurring, Mapping):
        out["periodSeconds"] = finite(recurring["period_s"], 1)
        out["nextDueInSeconds"] = finite(recurring["next_onset"] - decision.time, 1)
        out["peakNeed"] = recurring["peak_need"]
        out["confirmed"] = recurring["confirmed"]
    return out


def stream_status(health: Mapping[str, Any], endpoints: int) -> dict[str, Any]:
    """``status.streams`` from :meth:`StreamTable.health`."""
    stale = list(health.get("stale", []))
    rejected = {str(k): int(v) for k, v in dict(health.get("rejected", {})).items()}
    return {
        "endpoints": endpoints,
        "total": int(health.get("streams", 0)),
        "connected": int(health.get("fresh", 0)),
        "stale": len(stale),
        "staleStreams": stream_names(stale),
        "messages": int(health.get("messages", 0)),
        "passes": int(health.get("passes", 0)),
        "heartbeats": int(health.get("heartbeats", 0)),
        "gaps": int(health.get("lost", 0)),
        "restarts": int(health.get("restarts", 0)),
        "duplicates": int(health.get("duplicates", 0)),
        "malformed": sum(rejected.values()),
        "malformedByReason": rejected,
        "shedding": bool(health.get("shedding", False)),
        "shedMessages": int(health.get("shed_messages", 0)),
        "strayStreams": int(health.get("stray_streams", 0)),
        "strayMessages": int(health.get("stray_messages", 0)),
    }


def build_conditions(
    *,
    now_wall: float,
    generation: int | None,
    previous: Sequence[Mapping[str, Any]],
    problems: Sequence[str],
    mode: str,
    load: LoadEstimate | None,
    model_ready: bool,
    samples: int,
    min_samples: int,
    mape: float | None,
    api_error: str | None = None,
    decision: Decision | None = None,
) -> list[dict[str, Any]]:
    """The four conditions: MetricsFresh, ModelReady, ScalingActive, Degraded; and
    SloReachable when ``decision`` judged the load on the model."""

    def cond(ctype: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
        return condition(ctype, ok, reason, message, now_wall, generation, previous)

    if load is None or load.streams_total == 0:
        fresh = cond("MetricsFresh", False, "NoStreams", "no Ready pod publishes FPM yet")
    elif load.complete:
        fresh = cond(
            "MetricsFresh", True, "AllStreamsFresh", f"{load.streams_total} streams report"
        )
    else:
        fresh = cond(
            "MetricsFresh",
            False,
            "StreamsStale",
            f"{load.streams_missing} of {load.streams_total} streams are silent or missing; "
            "holding the replica count",
        )
    if model_ready:
        mape_text = "" if mape is None else f", MAPE {100 * mape:.1f}%"
        model = cond("ModelReady", True, "Fitted", f"{samples} passes learned{mape_text}")
    else:
        model = cond(
            "ModelReady",
            False,
            "Learning",
            f"{samples} of {min_samples} passes learned; scaling on queue length until then",
        )
    if problems:
        active = cond("ScalingActive", False, "InvalidSpec", "the spec is invalid (see Degraded)")
        degraded = cond("Degraded", True, "InvalidSpec", "; ".join(problems))
    else:
        if mode == "disabled":
            active = cond("ScalingActive", False, "Disabled", "autoscaling.enabled is false")
        elif mode == "advisory":
            active = cond(
                "ScalingActive", False, "Advisory", "decisions are recorded, never applied"
            )
        elif fresh["status"] != "True":
            active = cond("ScalingActive", False, "HoldingOnMissingData", fresh["message"])
        else:
            active = cond("ScalingActive", True, "Scaling", "the planner sets the replica count")
        if api_error:
            degraded = cond("Degraded", True, "KubernetesApiError", api_error)
        else:
            degraded = cond("Degraded", False, "AsExpected", "")
    conditions = [fresh, model, active, degraded]
    reachable = (
        reachability_condition(decision, now_wall, generation, previous) if decision else None
    )
    if reachable is not None:
        conditions.append(reachable)
    else:
        # Keep the last known reachability while the load cannot be judged.
        conditions.extend(dict(c) for c in previous if c.get("type") == "SloReachable")
    return conditions


def build_status(
    *,
    now_wall: float,
    generation: int | None,
    selector: str,
    mode: str,
    replicas: int,
    ready_replicas: int,
    desired_replicas: int,
    conditions: list[dict[str, Any]],
    cost_model_snapshot: Mapping[str, Any] | None,
    load: LoadEstimate | None,
    decision: Decision | None,
    decision_applied: bool,
    last_scaling: Mapping[str, Any] | None,
    stream_health: Mapping[str, Any] | None,
    endpoints: int,
) -> dict[str, Any]:
    """The whole status as a merge patch (see the module docstring)."""
    last_decision = (
        decision_status(decision, now_wall, decision_applied) if decision is not None else None
    )
    if last_decision is not None and decision is not None and decision.action != "hold":
        last_scaling = last_decision
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": replicas,
        "readyReplicas": ready_replicas,
        "desiredReplicas": desired_replicas,
        "selector": selector,
        "mode": mode,
        "conditions": conditions,
        "costModel": (
            cost_model_status(cost_model_snapshot) if cost_model_snapshot is not None else None
        ),
        "load": load_status(load),
        "predictions": {
            "current": prediction_status(decision.predicted_current if decision else None),
            "desired": prediction_status(decision.predicted_desired if decision else None),
            "measured": measured_status(decision),
            "unreachableShare": (
                finite(decision.inputs.get("unreachable_share"), 4) if decision else None
            ),
        },
        "lastDecision": last_decision,
        "lastScaling": dict(last_scaling) if last_scaling else None,
        "streams": stream_status(stream_health or {}, endpoints),
        "updatedAt": rfc3339(now_wall),
    }
    # Only a decision judged on the model knows of bursts; a hold on stale data
    # leaves the last known ``bursts`` as it was (absent from the merge patch).
    if decision is not None and "burst_seen_s_ago" in decision.inputs:
        status["bursts"] = burst_status(decision, now_wall)
    cleaned: dict[str, Any] = json_clean(status)
    return cleaned


def round_status(
    result: DecisionRound,
    *,
    now_wall: float,
    generation: int | None,
    previous_conditions: Sequence[Mapping[str, Any]],
    mode: str,
    min_samples: int,
    selector: str,
    replicas: int,
    ready_replicas: int,
    desired_replicas: int,
    decision_applied: bool,
    last_scaling: Mapping[str, Any] | None,
    api_error: str | None = None,
) -> dict[str, Any]:
    """The status a decision round writes: the conditions its load, model and
    decision give, and the whole status around them (what the operator's timer, the
    demo and the ingest benchmark all write)."""
    snapshot = result.cost_model_snapshot
    conditions = build_conditions(
        now_wall=now_wall,
        generation=generation,
        previous=previous_conditions,
        problems=(),
        mode=mode,
        load=result.load,
        model_ready=bool(snapshot.get("ready")),
        samples=int(snapshot.get("samples", 0) or 0),
        min_samples=min_samples,
        mape=(snapshot.get("quality") or {}).get("mape"),
        api_error=api_error,
        decision=result.decision,
    )
    return build_status(
        now_wall=now_wall,
        generation=generation,
        selector=selector,
        mode=mode,
        replicas=replicas,
        ready_replicas=ready_replicas,
        desired_replicas=desired_replicas,
        conditions=conditions,
        cost_model_snapshot=snapshot,
        load=result.load,
        decision=result.decision,
        decision_applied=decision_applied,
        last_scaling=last_scaling,
        stream_health=result.stream_health,
        endpoints=result.endpoints,
    )


def bursts_from_status(status: Mapping[str, Any] | None) -> list[tuple[float, int]]:
    """The recent bursts saved in ``status.bursts.recent``: (wall-clock onset, peak
    need); entries that do not parse are skipped."""
    bursts = status.get("bursts") if isinstance(status, Mapping) else None
    recent = bursts.get("recent") if isinstance(bursts, Mapping) else None
    out: list[tuple[float, int]] = []
    for item in recent if isinstance(recent, list) else []:
        if not isinstance(item, Mapping):
            continue
        onset = parse_timestamp(item.get("onset"))
        peak = item.get("peakNeed")
        if onset is not None and isinstance(peak, int) and not isinstance(peak, bool):
            out.append((onset, peak))
    return out


def checkpoint_from_status(status: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The cost-model checkpoint saved in ``status.costModel``, if any (warm restart)."""
    if not isinstance(status, Mapping):
        return None
    cm = status.get("costModel")
    if not isinstance(cm, Mapping):
        return None
    checkpoint = cm.get(CHECKPOINT_KEY)
    return dict(checkpoint) if isinstance(checkpoint, Mapping) else None
