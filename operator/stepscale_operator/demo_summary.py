"""What ``stepscale demo`` saw, round by round, and the summary it ends with.

Each decision round records the recommendation with its reason, the model's
predicted p99 TTFT/ITL at the running replicas, and the p99 TTFT/ITL the demo's
own requests measured as a client over the last few seconds. The summary lists
the changes of the recommendation, how close the predictions came to the
measurements, and what the recommendation would have cost against the one
engine that ran.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stepscale_operator.latency_model import SloTargets
from stepscale_operator.local_engine import ClientLatency


@dataclass(frozen=True)
class MeasuredLatency:
    """p99 TTFT and p99 ITL (ms) of the requests that finished in a window."""

    requests: int
    ttft_p99_ms: float | None
    itl_p99_ms: float | None

    @classmethod
    def of(cls, finished: Sequence[ClientLatency]) -> MeasuredLatency:
        """The window's percentiles (None without requests)."""
        if not finished:
            return cls(0, None, None)
        ttft = np.array([r.ttft_ms for r in finished])
        itl = np.array([r.itl_ms for r in finished])
        return cls(len(finished), float(np.percentile(ttft, 99)), float(np.percentile(itl, 99)))


@dataclass(frozen=True)
class Round:
    """One decision round of the demo."""

    t_s: float
    desired: int
    action: str
    reason: str
    predicted_ttft_ms: float | None
    predicted_itl_ms: float | None
    measured: MeasuredLatency
    queued: float = 0.0  # prefill requests waiting in the engine


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


@dataclass
class DemoRecord:
    """The rounds of one demo run."""

    rounds: list[Round] = field(default_factory=list)

    def add(self, t_s: float, status: Mapping[str, Any], measured: MeasuredLatency) -> Round:
        """Record the round whose status (as the operator writes it) is ``status``."""
        decision = status.get("lastDecision") or {}
        current = (status.get("predictions") or {}).get("current") or {}
        queued = _number((status.get("load") or {}).get("queuedPrefillRequests"))
        desired = status.get("desiredReplicas")
        entry = Round(
            t_s=t_s,
            desired=int(desired) if isinstance(desired, int | float) else 0,
            action=str(decision.get("action", "-")),
            reason=str(decision.get("reason", "")),
            predicted_ttft_ms=_number(current.get("ttftMs")),
            predicted_itl_ms=_number(current.get("itlMs")),
            measured=measured,
            queued=queued or 0.0,
        )
        self.rounds.append(entry)
        return entry

    def changes(self) -> list[tuple[int, Round]]:
        """``(previous desired, round)`` for every round whose recommendation changed."""
        out: list[tuple[int, Round]] = []
        for before, now in zip(self.rounds, self.rounds[1:], strict=False):
            if now.desired != before.desired:
                out.append((before.desired, now))
        return out

    def prediction_errors(self, queued: bool | None = None) -> dict[str, tuple[float, int]]:
        """Median relative error of predicted vs measured p99, and the rounds compared,
        per metric (rounds with at least 5 measured requests; only those with
        (``True``) or without (``False``) a prefill queue if told)."""
        out: dict[str, tuple[float, int]] = {}
        rounds = [r for r in self.rounds if queued is None or (r.queued >= 1.0) == queued]
        for metric in ("ttft", "itl"):
            errors = []
            for r in rounds:
                predicted = getattr(r, f"predicted_{metric}_ms")
                measured = getattr(r.measured, f"{metric}_p99_ms")
                if predicted is not None and measured and r.measured.requests >= 5:
                    errors.append(abs(predicted - measured) / measured)
            if errors:
                out[metric] = (float(np.median(errors)), len(errors))
        return out

    def replica_seconds(self) -> float:
        """Replica-seconds the recommendations add up to (each held until the next)."""
        total = 0.0
        for now, after in zip(self.rounds, self.rounds[1:], strict=False):
            total += now.desired * (after.t_s - now.t_s)
        return total


def summary_lines(
    record: DemoRecord,
    finished: Sequence[ClientLatency],
    slo: SloTargets,
    status: Mapping[str, Any],
    running_replicas: int,
) -> list[str]:
    """The demo's closing summary: decisions, model accuracy, what it would have done."""
    lines = ["", "Summary"]
    changes = record.changes()
    lines.append(
        f"  decisions  {len(record.rounds)} rounds; the recommendation changed "
        f"{len(changes)} times:"
    )
    for before, r in changes:
        lines.append(f"    at {r.t_s:4.0f}s  {before} -> {r.desired}  {r.action}: {r.reason}")
    cm = status.get("costModel") or {}
    mape = cm.get("mapePercent")
    passes = (status.get("streams") or {}).get("passes", 0)
    lines.append(
        "  model      step time: prequential MAPE "
        + (f"{mape:.0f}%" if isinstance(mape, int | float) else "-")
        + f" over {passes} passes"
    )
    for queued, when in ((False, "without a queue"), (True, "with requests queued")):
        errors = record.prediction_errors(queued)
        if errors:
            lines.append(
                f"             predicted vs measured p99, rounds {when}: "
                + ", ".join(f"{m.upper()} {e:.0%} off ({n})" for m, (e, n) in errors.items())
            )
    if any(r.queued >= 1.0 for r in record.rounds):
        lines.append(
            "             (with a queue the measured TTFT is mostly waiting, which the "
            "prediction at the served load leaves out: the planner sizes the backlog apart)"
        )
    if finished:
        ttft_ok = sum(r.ttft_ms <= slo.ttft_ms for r in finished) / len(finished)
        itl_ok = sum(r.itl_ms <= slo.itl_ms for r in finished) / len(finished)
        lines.append(
            f"  measured   {len(finished)} requests on {running_replicas} real engine: "
            f"TTFT within {slo.ttft_ms:g} ms {ttft_ok:.0%}, ITL within {slo.itl_ms:g} ms "
            f"{itl_ok:.0%}"
        )
    if len(record.rounds) > 1:
        span = record.rounds[-1].t_s - record.rounds[0].t_s
        peak = max(record.rounds, key=lambda r: r.desired)
        lines.append(
            f"  would have run up to {peak.desired} replicas (at {peak.t_s:.0f}s); "
            f"{record.replica_seconds():.0f} replica-seconds over {span:.0f}s against "
            f"{running_replicas * span:.0f} for the {running_replicas} that ran"
        )
    return lines
