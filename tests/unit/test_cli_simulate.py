"""``stepscale simulate`` and the subcommand registry, through the real argument parser."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from stepscale_operator import cli
from stepscale_operator.simulate_cli import _Progress, _traffic
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B
from stepscale_operator.simulator.readme_scenarios import BURSTS, README_POLICIES
from stepscale_operator.simulator.report import (
    REQUEST_CSV_COLUMNS,
    RunSummary,
    format_table,
    replica_axis_top,
)
from stepscale_operator.simulator.traffic import synthetic


def test_every_subcommand_is_registered() -> None:
    assert list(cli.SUBCOMMANDS) == ["tail", "demo", "operator", "simulate"]
    args = cli.build_parser().parse_args(["operator", "-n", "a", "-n", "b", "--standalone"])
    assert args.namespace == ["a", "b"] and args.standalone


# Fast ground-truth calibration: shorter stretches, fewer bisection steps.
QUICK_CALIBRATION = ["--calibration-s", "60", "--calibration-iterations", "3"]
CHEAP_CALIBRATION = ["--calibration-s", "20", "--calibration-iterations", "1"]


def test_simulate_writes_a_row_per_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    status = cli.main(
        [
            "simulate",
            "--synthetic",
            "diurnal",
            "--base-rps",
            "20",
            "--duration-s",
            "600",
            "--policy",
            "all",
            "--json",
            str(out),
            "--no-progress",
            *QUICK_CALIBRATION,
        ]
    )
    assert status == 0
    payload = json.loads(out.read_text())
    runs = {r["policy"]: r for r in payload["runs"]}
    # "all" is every policy the README names; the burst memory alone only on bursts.
    assert set(runs) == set(README_POLICIES) - {"ours@memory"}
    assert payload["traffic"]["requests"] > 0
    assert all(
        r["unfinished"] == 0 and r["requests"] == payload["traffic"]["requests"]
        for r in runs.values()
    )
    # The oracle is sized by the simulated ground truth for 99%: it gets there.
    assert runs["oracle"]["attainment"] >= 0.99
    # Scaling down only after a window costs the oracle capacity, never saves it.
    assert runs["oracle+window"]["gpu_hours"] >= runs["oracle"]["gpu_hours"]
    # The load swings from 40% to 160% of its base: ours follows it instead of
    # holding the peak, and stays near the oracle's cost (a reference sized by a
    # heuristic, not a strict lower bound) while serving nearly every request.
    ours, static, oracle = runs["ours"], runs["static"], runs["oracle"]
    assert ours["scale_events"] >= 1 and ours["gpu_hours"] < static["gpu_hours"]
    assert 0.8 * oracle["gpu_hours"] <= ours["gpu_hours"] <= 1.5 * oracle["gpu_hours"]
    assert ours["attainment"] >= 0.95
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("synthetic-diurnal")]
    assert "TTFT p99 ms" in table and len(rows) == len(runs)


def test_simulate_writes_one_csv_row_per_request(tmp_path: Path) -> None:
    path = tmp_path / "requests.csv"
    args = ["simulate", "--synthetic", "flat", "--duration-s", "60", "--base-rps", "5"]
    args += ["--policy", "static"]
    assert cli.main([*args, "--requests-csv", str(path), "--no-progress", *CHEAP_CALIBRATION]) == 0
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == REQUEST_CSV_COLUMNS
    assert len(rows) == len(synthetic("flat", 60.0, 5.0, seed=0))
    assert [int(r["request"]) for r in rows] == list(range(len(rows)))
    for r in rows:
        assert r["policy"] == "static" and r["replica"] != ""
        assert float(r["ttft_ms"]) > 0.0 and float(r["itl_ms"]) >= 0.0
        assert int(r["prompt_tokens"]) >= 16 and int(r["preemptions"]) == 0
    arrivals = [float(r["arrival_s"]) for r in rows]
    assert arrivals == sorted(arrivals) and arrivals[-1] < 60.0


def test_time_compress_plays_a_trace_faster(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            f'{{"timestamp": {i * 500}, "input_length": 300, "output_length": 20}}\n'
            for i in range(200)
        )
    )
    payloads = []
    for compress in ("1", "4"):
        out = tmp_path / f"x{compress}.json"
        argv = ["simulate", "--trace", str(trace), "--policy", "hpa", "--time-compress", compress]
        assert cli.main([*argv, "--json", str(out), "--no-progress", *CHEAP_CALIBRATION]) == 0
        payloads.append(json.loads(out.read_text())["traffic"])
    normal, fast = payloads
    assert normal["requests"] == fast["requests"] == 200
    assert normal["duration_s"] == pytest.approx(100.5)  # last arrival 99.5 s, plus 1 s
    assert fast["duration_s"] == pytest.approx(100.5 / 4.0)


def test_profile_and_noise_override_the_ground_truth(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"flops_per_s": 4.0e14, "overhead_s": 0.002}))
    argv = ["simulate", "--synthetic", "flat", "--duration-s", "60", "--policy", "hpa"]
    extra = ["--profile", str(profile), "--noise-sigma", "0", "--json", str(out)]
    assert cli.main([*argv, *extra, "--no-progress", *CHEAP_CALIBRATION]) == 0
    used = json.loads(out.read_text())["profile"]
    assert used["flops_per_s"] == 4.0e14 and used["overhead_s"] == 0.002
    assert used["noise_sigma"] == 0.0 and used["layers"] == H100_LLAMA_8B.layers
    inline = ["--profile", '{"flops_per_s": 5e14}', "--json", str(out)]
    assert cli.main([*argv, *inline, "--no-progress", *CHEAP_CALIBRATION]) == 0
    assert json.loads(out.read_text())["profile"]["flops_per_s"] == 5.0e14


def test_a_bad_profile_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--synthetic", "flat", "--profile", '{"warp_speed": 9}', "--no-progress"]
    assert cli.main(argv) == 2
    assert "unknown profile fields" in capsys.readouterr().err


def test_progress_counts_whole_requests_and_never_overshoots() -> None:
    updates: list[int] = []

    class Bar:
        def update(self, n: int) -> None:
            updates.append(n)

        def set_description(self, label: str) -> None:
            pass

    arrivals = np.sort(np.random.default_rng(0).uniform(0.0, 100.0, 537))
    progress = _Progress(arrivals, policies=2, enabled=False, realtime=0.0)
    progress._bar = Bar()
    # Ticks every 0.7 simulated seconds, then the drain after the traffic ends.
    for label in ("ours", "hpa"):
        for now in (*np.arange(0.0, 100.0, 0.7), 100.0, 130.0, 160.0):
            progress(label, float(now))
    assert sum(updates) == progress.total == 2 * 537  # the bar's total: requests x policies
    assert all(isinstance(u, int) and u > 0 for u in updates)


def test_every_policy_the_readme_names_is_selectable(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    names = "ours@memory,dynamo@0.4,oracle+window,hindsight,dynamo@0.25"
    argv = ["simulate", "--synthetic", "flat", "--duration-s", "60", "--policy", names]
    assert cli.main([*argv, "--json", str(out), "--no-progress", *CHEAP_CALIBRATION]) == 0
    runs = [r["policy"] for r in json.loads(out.read_text())["runs"]]
    assert runs == names.split(",")


def test_the_bursts_scenario_is_the_readmes() -> None:
    args = cli.build_parser().parse_args(["simulate", "--synthetic", "bursts"])
    traffic = _traffic(args)
    # 40 req/s, bursts to 100 req/s every 10 min, 30 min: what the README's table measured.
    assert traffic.name == "synthetic-bursts" and traffic.duration_s == 1800.0
    _, rps = traffic.rates(60.0)
    assert 36.0 < float(np.median(rps)) < 44.0 and 90.0 < float(rps.max()) < 110.0
    again = BURSTS.traffic(seed=0)
    assert np.array_equal(traffic.arrival_s, again.arrival_s)


def _row(policy: str, attainment: float, gpu_hours: float) -> RunSummary:
    return RunSummary(
        "s", policy, 10, attainment, attainment, attainment, 1.0, 2.0, 1.0, 2.0,
        gpu_hours, 1.0, 1, 0, 0, 0, 1, 0, 0.1,
    )  # fmt: skip


def test_table_explains_a_policy_below_the_oracle_and_never_prints_nan() -> None:
    rows = [_row("oracle", 0.999, 2.0), _row("dynamo", 0.6, 1.0), _row("ours", 0.99, 2.4)]
    table = format_table(rows, {"s": 2.0})
    dynamo = next(line for line in table.splitlines() if " dynamo " in line)
    assert "0.50*" in dynamo
    assert "* s dynamo: 0.50x the oracle's GPU-hours; misses the SLO more (60.00%" in table
    assert table.count("*") == 2  # only the row below the oracle and its note
    alone = format_table([_row("ours", 0.99, 2.4)], {})
    assert "nan" not in alone and alone.splitlines()[-1].split()[-4] == "-"


def test_outputs_named_without_a_directory_go_under_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["simulate", "--synthetic", "flat", "--duration-s", "30", "--policy", "hpa"]
    assert (
        cli.main([*argv, "--json", "--plot", "mine.png", "--no-progress", *CHEAP_CALIBRATION]) == 0
    )
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == [
        "mine.png",
        "simulate_synthetic-flat.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]
    elsewhere = tmp_path / "out" / "x.json"
    elsewhere.parent.mkdir()
    assert cli.main([*argv, "--json", str(elsewhere), "--no-progress", *CHEAP_CALIBRATION]) == 0
    assert elsewhere.exists()
    assert (
        cli.main([*argv, "--plot", str(elsewhere.parent), "--no-progress", *CHEAP_CALIBRATION]) == 0
    )
    assert (elsewhere.parent / "timeline_synthetic-flat.png").exists()


def test_replica_axis_clips_only_an_outlier() -> None:
    # HPA running to 64 would squash the 5-15 replicas the others use.
    assert replica_axis_top([9, 10, 8, 64, 9]) < 15
    assert replica_axis_top([9, 10, 8, 12]) > 12


def test_simulate_reports_an_unreadable_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(["simulate", "--trace", str(tmp_path / "missing.csv"), "--no-progress"])
    assert status == 2
    assert "missing.csv: No such file or directory" in capsys.readouterr().err


def test_simulate_needs_a_traffic_source() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate"])
    assert exc.value.code == 2
