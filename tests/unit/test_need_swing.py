"""benchmarks/need_swing.py: which of a load's fields swings the recomputed need."""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

from tests.conftest import benchmark_module
from tests.unit.test_planner import inputs_for, load_of


def _module() -> ModuleType:
    return benchmark_module("need_swing")


def test_a_swing_is_told_apart_from_the_rates_and_named_by_its_field() -> None:
    # Six decisions: the request rate alternates 30/50 req/s, and the decode
    # context, on its own, alternates 1k/20k tokens (deeper KV reads slow every
    # decode). The need swings as measured; with the rates held only the context
    # moves it, and its own row says so. Fields that never change get no row.
    ns = _module()
    captured = []
    for i in range(6):
        load = replace(
            load_of(30.0 if i % 2 else 50.0, prompt=2000.0),
            mean_decode_context_tokens=1000.0 if i < 3 else 20000.0,
        )
        captured.append((inputs_for(load, 4), load))
    rows = {swing.name: swing.row() for swing in ns.swings(captured)}
    assert rows["as measured"]["sd"] > 0.0
    assert rows["rates held"]["min"] < rows["rates held"]["max"]
    context = rows["mean_decode_context_tokens"]
    assert context["min"] < context["max"]
    assert "arrival_dispersion" not in rows
    assert "prompt_histogram" not in rows
    # The rates held at their mean (40 req/s) and the context at 1k: the need of
    # that one load, whichever decision it came from.
    steady = replace(load_of(40.0, prompt=2000.0), mean_decode_context_tokens=1000.0)
    assert context["min"] == ns.need_of(inputs_for(steady, 4), steady)
