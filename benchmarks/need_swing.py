"""What swings the planner's need at a steady load, field by field.

The fleet scales up on any one decision and down only when the whole
stabilization window agrees, so a need that swings from one 30 s window to the
next keeps the fleet at the top of its swing. This runs one ``bench_policies.py``
scenario with the planner driving (as ``bench_prediction.py``'s ``@0`` runs do),
keeps the planner's inputs at every decision in ``[--from-s, --to-s]``, and
recomputes the capacity need from each (the SLO less the planning margin, no
look-ahead and no history) three ways:

* ``as measured``: each decision's own load estimate;
* ``rates held``: the request and token rates held at their mean over the span,
  every other field the decision's own (what the rates' noise leaves out);
* one row per field that moves it: the rates held and every other field held at
  the middle decision's, only this field the decision's own.

A field whose row swings as much as ``as measured`` is what to settle. On long
context (seed 0, 700-1,000 s, a steady 1.9 req/s on 13-14 replicas) the need read
7-15 (sd 1.91 replicas; 1.44 with the rates held); the window's prompt histogram
(which the demand stage pools) swung it by 2.02 and the router's decode deficit
by 1.58 (``docs/planner-history.md``, 2026-12-02).
Prints the table; writes ``need_swing.json``.

    PYTHONPATH=engine_plugin:operator .venv/bin/python benchmarks/need_swing.py \\
        --scenario shaped-long-context --from-s 700 --to-s 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_policies as bp  # noqa: E402
from bench_prediction import scenario_traffic  # noqa: E402

from stepscale_operator.capacity_need import (  # noqa: E402
    latency_predictions,
    planning_margin,
    smallest_within_reach,
)
from stepscale_operator.load_types import LoadEstimate  # noqa: E402
from stepscale_operator.planner import Decision, Planner, PlannerInputs, PlannerPolicy  # noqa: E402
from stepscale_operator.simulator.fleet import Fleet  # noqa: E402
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B  # noqa: E402
from stepscale_operator.simulator.policies import PlannerDrivenPolicy  # noqa: E402

RATES = (
    "prefill_tokens_per_s",
    "prefill_requests_per_s",
    "decode_tokens_per_s",
    "prefill_cached_tokens_per_s",
)
# What says which streams and window a load is of, not what it is.
BOOKKEEPING = ("window_s", "streams_total", "streams_missing", "missing_streams", "unavailable")


class CapturingPlanner(Planner):
    """The planner, keeping its inputs at the decisions within ``[start, end]``."""

    def __init__(self, start: float, end: float) -> None:
        super().__init__()
        self.start, self.end = start, end
        self.captured: list[tuple[PlannerInputs, LoadEstimate]] = []

    def decide(self, inputs: PlannerInputs, now: float) -> Decision:
        """Decide as always; within the span, keep the inputs that carry a load
        estimate and a ready cost model."""
        if self.start <= now <= self.end and inputs.load is not None and inputs.model_ready:
            self.captured.append((inputs, inputs.load))
        return super().decide(inputs, now)


@dataclass(frozen=True)
class Swing:
    """The needs of one way of recomputing them."""

    name: str
    needs: list[int]

    def row(self) -> dict[str, object]:
        """Mean, standard deviation and range of the needs."""
        return {
            "name": self.name,
            "mean": statistics.fmean(self.needs),
            "sd": statistics.pstdev(self.needs),
            "min": min(self.needs),
            "max": max(self.needs),
        }


def need_of(inputs: PlannerInputs, load: LoadEstimate) -> int:
    """The fewest replicas whose predicted latency for ``load`` meets the SLO less
    the planning margin (no look-ahead, no floors, no history)."""
    policy = PlannerPolicy()
    margin = planning_margin(policy, inputs.model_mape)
    predict = latency_predictions(inputs, policy)
    needed, _, _ = smallest_within_reach(
        policy, inputs.slo, load, margin, inputs.max_replicas, predict
    )
    return needed


def swings(captured: list[tuple[PlannerInputs, LoadEstimate]]) -> list[Swing]:
    """The needs as measured, with the rates held, and with each field alone."""
    loads = [load for _, load in captured]
    mean_rates = {name: statistics.fmean(getattr(load, name) for load in loads) for name in RATES}
    middle = replace(loads[len(loads) // 2], **mean_rates)
    shape = [
        f.name for f in fields(LoadEstimate) if f.name not in RATES and f.name not in BOOKKEEPING
    ]
    out = [
        Swing("as measured", [need_of(i, load) for i, load in captured]),
        Swing("rates held", [need_of(i, replace(load, **mean_rates)) for i, load in captured]),
    ]
    for name in shape:
        needs = [need_of(i, replace(middle, **{name: getattr(load, name)})) for i, load in captured]
        if len(set(needs)) > 1:
            out.append(Swing(name, needs))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", default="shaped-long-context")
    parser.add_argument("--from-s", type=float, default=700.0)
    parser.add_argument("--to-s", type=float, default=1000.0)
    parser.add_argument("--start", type=int, default=6, help="replicas the run starts with")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(bp.REPO / "results"))
    args = parser.parse_args()

    traffic, setup = scenario_traffic(args.scenario, args.to_s + 5.0, args.seed)
    planner = CapturingPlanner(args.from_s, args.to_s)
    policy = PlannerDrivenPolicy(setup, planner=planner)
    Fleet(traffic, policy, setup.fleet_config(H100_LLAMA_8B, args.start, args.seed)).run()
    if not planner.captured:
        raise SystemExit(f"no judged decision in {args.from_s:.0f}-{args.to_s:.0f} s")
    rows = [swing.row() for swing in swings(planner.captured)]

    print(
        f"{args.scenario} seed {args.seed}, {len(planner.captured)} decisions in "
        f"{args.from_s:.0f}-{args.to_s:.0f} s: the need recomputed"
    )
    print(f"{'':32} {'mean':>6} {'sd':>6} {'min':>4} {'max':>4}")
    for row in rows:
        print(
            f"{row['name']:32} {row['mean']:6.2f} {row['sd']:6.2f} {row['min']:4d} {row['max']:4d}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "need_swing.json"
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
