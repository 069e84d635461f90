"""How many passes of a kind the cost model has never seen it takes to learn them.

A fleet that served short prompts for hours starts getting long conversations
whose prefix is cached: prefill chunks that attend over 60k tokens of cached
context. The fit extrapolates their cost from passes without any; the truth can
be several times that. The stall gate must tell such a pass (the model is wrong,
learn it) from a stalled one (the machine was slow, don't): by where the pass
falls (a coverage bucket the fit has data in is gated narrowly, a bucket it has
not seen widely), and by what else the stream sends meanwhile (a stall slows all
of its passes, a misfit one kind: :mod:`stepscale_operator.cost_model.misfit`).

The stream (synthetic: the simulator's H100 / Llama-8B step times, with its 3%
log-normal noise): ``--warm`` passes of the usual mix with no cached prefix,
then a ``--share`` of the passes (every fifth by default; evenly spaced) a single
64-2,048-token chunk over a ``--context``-token cached prefix, taking ``factor``
times what the fit predicted for it at the switch (``--share 0.8``: a prefill
worker that now meets a cached prefix on most requests). Passes arrive in
subscriber batches of ``--batch``; each is predicted before it is learned. Per
factor the table gives how many of them it took until a group of 20 is predicted
within 15% (median), for the cost model as it is and with its stall gate off
(nothing rejected, so every stall run would be learned too; a comparison, not a
bound), and the model's median error at a few points. Stall runs are 10-30x, so
a kind that far off may stay unlearned for a while by design.

    PYTHONPATH=engine_plugin:operator .venv/bin/python benchmarks/bench_new_pass_kind.py

Prints the table; writes ``results/new_pass_kind.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from stepscale_operator.cost_model import CostModel
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B

REPO = Path(__file__).resolve().parents[1]
GROUP = 20  # new-kind passes per reported group
LEARNED = 0.15  # a group's median |error| within this: learned


def step_times(rows: np.ndarray) -> np.ndarray:
    """Noise-free pass times of the simulator's H100 / Llama-8B profile (a roofline)."""
    return np.array([H100_LLAMA_8B.mean_time(r[1], r[3], r[0], r[4], r[5]) for r in rows])


def usual_passes(rng: np.random.Generator, n: int) -> np.ndarray:
    """(n, 7) compositions of the usual mix with no cached prefix: decode batches of
    1-256 at 64-8,192 tokens of context, prefill chunks of 16-2,048 tokens for 1-3
    requests, alone or beside decodes."""
    rows = np.zeros((n, 7))
    kind = rng.random(n)
    has_p, has_d = kind >= 0.5, kind < 0.85
    rows[:, 0] = np.where(has_p, rng.integers(1, 4, n), 0)
    rows[:, 1] = np.where(has_p, np.exp(rng.uniform(np.log(16), np.log(2048), n)).round(), 0.0)
    decodes = np.where(has_d, np.exp(rng.uniform(0.0, np.log(256), n)).round(), 0.0)
    rows[:, 4] = decodes
    rows[:, 5] = decodes * np.exp(rng.uniform(np.log(64), np.log(8192), n)).round()
    return rows


def new_kind_passes(rng: np.random.Generator, n: int, context: float) -> np.ndarray:
    """(n, 7): one 64-2,048-token prefill chunk over ``context`` cached tokens, no decodes."""
    rows = np.zeros((n, 7))
    rows[:, 0] = 1.0
    rows[:, 1] = rng.integers(64, 2048, n)
    rows[:, 3] = context
    return rows


# The gate off: no pass is ever rejected as a stall, and an unlearned bucket takes
# every pass at full weight (what would learn every stall run too). No bound on
# learning speed: far off, full-weight passes pull the fit to a compromise.
UNGATED = {"reject_k": 1e9, "unlearned_factor": 1e9}
# Where the table shows a group's median error: the first group, then after these
# many new-kind passes.
SHOWN_AT = (0, 100, 500, 1000, 1500)


def new_kind_batches(
    factor: float, args: argparse.Namespace, **model_kw: float
) -> Iterator[tuple[CostModel, np.ndarray]]:
    """The stream, batch by batch: the model at the switch (no errors yet), then
    after each batch and the new-kind passes' relative errors in it (predicted
    before learned). ``model_kw``: the cost model's settings, the defaults unless
    given."""
    rng = np.random.default_rng(args.seed)
    model = CostModel(warmup_passes=0, **model_kw)
    warm = usual_passes(rng, args.warm)
    noise = np.exp(rng.normal(0.0, args.noise, args.warm))
    for lo in range(0, args.warm, args.batch):
        part = slice(lo, lo + args.batch)
        times = step_times(warm[part]) * noise[part]
        model.update_batch(warm[part], times, [("w", 0)] * times.shape[0])
    at_switch = copy.deepcopy(model)  # frozen: later learning must not move the truth
    yield model, np.zeros(0)
    # The new kind's rows in each batch, evenly spaced (every fifth at a share of 0.2).
    per_batch = max(1, min(args.batch, round(args.share * args.batch)))
    new = np.floor(np.arange(per_batch) * args.batch / per_batch).astype(np.int64)
    for _ in range(-(-args.new // per_batch)):
        rows = usual_passes(rng, args.batch)
        rows[new] = new_kind_passes(rng, new.size, args.context)
        times = step_times(rows)
        # The new kind costs ``factor`` times what the fit made of it at the switch.
        times[new] = factor * at_switch.predict_many(rows[new], recent_offsets=False)
        times *= np.exp(rng.normal(0.0, args.noise, args.batch))
        predicted = model.update_batch(rows, times, [("w", 0)] * args.batch)
        yield model, (predicted[new] - times[new]) / times[new]


def learning_curve(factor: float, args: argparse.Namespace, **model_kw: float) -> dict[str, object]:
    """The new kind's errors, by group, for one factor off the fit's extrapolation."""
    errors: list[float] = []
    for _, batch_errors in new_kind_batches(factor, args, **model_kw):
        errors.extend(batch_errors.tolist())
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
    parser.add_argument(
        "--share",
        type=float,
        default=0.2,
        help="the new kind's share of the passes after the switch",
    )
    parser.add_argument("--noise", type=float, default=H100_LLAMA_8B.noise_sigma)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "results"))
    args = parser.parse_args()

    factors = [float(f) for f in args.factors.split(",")]
    gated = [learning_curve(f, args) for f in factors]
    ungated = [learning_curve(f, args, **UNGATED) for f in factors]
    print(
        f"new kind: one chunk over {args.context:.0f} cached tokens, {args.share:.0%} of the "
        f"passes after {args.warm} without; {args.new} of them"
    )
    shown = [at for at in SHOWN_AT if at < args.new]
    heads = " ".join(f"{'err@' + str(at):>8}" for at in shown)
    print(f"{'factor':>7} {'learned after':>14} {'no gate':>8} {heads}")
    for ours, gate_off in zip(gated, ungated, strict=True):
        groups: list[float] = ours["group_median_abs_error"]  # type: ignore[assignment]
        errs = " ".join(f"{groups[at // GROUP]:8.0%}" for at in shown)
        print(
            f"{ours['factor']:7.1f} {_count(ours['passes_to_learn']):>14} "
            f"{_count(gate_off['passes_to_learn']):>8} {errs}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "new_pass_kind.json"
    path.write_text(json.dumps({"args": vars(args), "gated": gated, "ungated": ungated}, indent=2))
    print(f"(err@N: median |error| of the 20 new-kind passes after the first N)\nwrote {path}")


if __name__ == "__main__":
    main()
