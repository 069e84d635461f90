"""How many passes of a kind the cost model has never seen it takes to learn them.

A fleet that served short prompts for hours starts getting long conversations
whose prefix is cached: prefill chunks that attend over 60k tokens of cached
context. The fit extrapolates their cost from passes without any; the truth can
be several times that. The stall gate must tell such a pass (the model is wrong,
learn it) from a stalled one (the machine was slow, don't), and it can tell only
by where the pass falls: a coverage bucket the fit has data in is gated narrowly,
a bucket it has not seen widely.

The stream (synthetic, the unit tests' linear truth with 5% log-normal noise):
``--warm`` passes of the usual mix with no cached prefix, then every fifth pass a
single 64-2,048-token chunk over a ``--context``-token cached prefix, taking
``factor`` times what the fit predicted for it at the switch. Passes arrive in
subscriber batches of ``--batch``; each is predicted before it is learned. Per
factor the table gives how many of them it took until a group of 20 is predicted
within 15% (median), for the cost model as it is and with its stall gate off (the
limit: nothing rejected, but every stall run learned too), and the model's median
error at a few points. Stall runs are 10-30x, so a kind that far off may stay
unlearned for a while by design.

    PYTHONPATH=engine_plugin:operator .venv/bin/python benchmarks/bench_new_pass_kind.py

Prints the table; writes ``results/new_pass_kind.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import numpy as np

from stepscale_operator.cost_model import COEFFICIENT_NAMES, CostModel, regressor_matrix, roofline

REPO = Path(__file__).resolve().parents[1]
# The unit tests' linear truth (tests/unit/test_cost_model.py): a roofline with no
# memory side, as on a CPU engine.
TRUE = {
    "intercept": 4e-3,
    "prefill_requests": 5e-4,
    "decode_requests": 8e-5,
    "compute.tokens": 2e-5,
    "compute.prefill_attention": 3e-9,
    "compute.decode_kv_tokens": 2e-7,
}
TRUE_VEC = np.array([TRUE.get(name, 0.0) for name in COEFFICIENT_NAMES])
GROUP = 20  # new-kind passes per reported group
LEARNED = 0.15  # a group's median |error| within this: learned


def usual_passes(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 7) compositions of the usual mix: prefill-only, decode-only and mixed
    passes, no cached prefix."""
    rows = np.zeros((n, 7))
    has_p = rng.random(n) < 0.6
    has_d = (rng.random(n) < 0.7) | ~has_p
    n_pre = np.where(has_p, rng.integers(1, 4, n), 0)
    for i in np.flatnonzero(has_p):
        lens = rng.integers(16, 2048, n_pre[i])
        rows[i, 0], rows[i, 1], rows[i, 2] = n_pre[i], lens.sum(), lens.var()
    n_dec = np.where(has_d, rng.integers(1, 256, n), 0)
    rows[:, 4] = n_dec
    rows[:, 5] = n_dec * rng.integers(64, 4096, n)
    return rows


def new_kind_passes(rng: np.random.Generator, n: int, context: float) -> np.ndarray:
    """(n, 7): one 64-2,048-token prefill chunk over ``context`` cached tokens, no decodes."""
    rows = np.zeros((n, 7))
    rows[:, 0] = 1.0
    rows[:, 1] = rng.integers(64, 2048, n)
    rows[:, 3] = context
    return rows


# The gate off: no pass is ever rejected as a stall (the limit of learning speed,
# and what would learn every stall run too).
UNGATED = {"reject_k": 1e9, "unlearned_factor": 1e9}
# Where the table shows a group's median error: the first group, then after these
# many new-kind passes.
SHOWN_AT = (0, 100, 500, 1000, 1500)


def learning_curve(factor: float, args: argparse.Namespace, **model_kw: float) -> dict[str, object]:
    """The new kind's errors, by group, for one factor off the fit's extrapolation
    (``model_kw``: the cost model's settings, the defaults unless given)."""
    rng = np.random.default_rng(args.seed)
    model = CostModel(warmup_passes=0, **model_kw)
    warm = usual_passes(rng, args.warm)
    noise = np.exp(rng.normal(0.0, args.noise, args.warm))
    for lo in range(0, args.warm, args.batch):
        part = slice(lo, lo + args.batch)
        times = roofline(regressor_matrix(warm[part]), TRUE_VEC) * noise[part]
        model.update_batch(warm[part], times, [("w", 0)] * times.shape[0])
    at_switch = copy.deepcopy(model)  # frozen: later learning must not move the truth
    errors: list[float] = []
    for _ in range(args.new // (args.batch // 5)):
        rows = usual_passes(rng, args.batch)
        new = np.arange(0, args.batch, 5)
        rows[new] = new_kind_passes(rng, new.size, args.context)
        times = roofline(regressor_matrix(rows), TRUE_VEC)
        # The new kind costs ``factor`` times what the fit made of it at the switch.
        times[new] = factor * at_switch.predict_many(rows[new], recent_offsets=False)
        times *= np.exp(rng.normal(0.0, args.noise, args.batch))
        predicted = model.update_batch(rows, times, [("w", 0)] * args.batch)
        errors.extend(((predicted[new] - times[new]) / times[new]).tolist())
    groups = [float(np.median(np.abs(errors[i : i + GROUP]))) for i in range(0, len(errors), GROUP)]
    learned = next((i * GROUP for i, g in enumerate(groups) if g <= LEARNED), None)
    return {"factor": factor, "group_median_abs_error": groups, "passes_to_learn": learned}


def _count(learned: object) -> str:
    return "never" if learned is None else str(learned)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--factors", default="1.5,2.5,4,8,16,30")
    parser.add_argument("--warm", type=int, default=6000)
    parser.add_argument("--new", type=int, default=2000, help="new-kind passes per factor")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--context", type=float, default=60_000.0)
    parser.add_argument("--noise", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args()

    factors = [float(f) for f in args.factors.split(",")]
    gated = [learning_curve(f, args) for f in factors]
    ungated = [learning_curve(f, args, **UNGATED) for f in factors]
    print(
        f"new kind: one chunk over {args.context:.0f} cached tokens, every 5th pass "
        f"after {args.warm} without; {args.new} of them"
    )
    shown = [at for at in SHOWN_AT if at < args.new]
    heads = " ".join(f"{'err@' + str(at):>8}" for at in shown)
    print(f"{'factor':>7} {'learned after':>14} {'no gate':>8} {heads}")
    for ours, limit in zip(gated, ungated, strict=True):
        groups: list[float] = ours["group_median_abs_error"]  # type: ignore[assignment]
        errs = " ".join(f"{groups[at // GROUP]:8.0%}" for at in shown)
        print(
            f"{ours['factor']:7.1f} {_count(ours['passes_to_learn']):>14} "
            f"{_count(limit['passes_to_learn']):>8} {errs}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "new_pass_kind.json"
    path.write_text(json.dumps({"args": vars(args), "gated": gated, "ungated": ungated}, indent=2))
    print(f"(err@N: median |error| of the 20 new-kind passes after the first N)\nwrote {path}")


if __name__ == "__main__":
    main()
