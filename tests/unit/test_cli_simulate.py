"""``stepscale simulate`` and the subcommand registry, through the real argument parser."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from stepscale_operator import cli
from stepscale_operator.simulate_cli import _Progress
from stepscale_operator.simulator.ground_truth import H100_LLAMA_8B
from stepscale_operator.simulator.report import REQUEST_CSV_COLUMNS
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
    assert set(runs) == {"ours", "static", "hpa", "dynamo", "oracle", "oracle+window", "hindsight"}
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
    assert "TTFT p99 ms" in table and table.count("synthetic-diurnal") == len(runs)


def test_simulate_writes_one_csv_row_per_request(tmp_path: Path) -> None:
    path = tmp_path / "requests.csv"
    args = ["simulate", "--synthetic", "flat", "--duration-s", "60", "--policy", "static"]
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


def test_progress_advances_by_simulated_time_and_never_overshoots() -> None:
    updates: list[float] = []

    class Bar:
        def update(self, n: float) -> None:
            updates.append(n)

        def set_description(self, label: str) -> None:
            pass

    progress = _Progress(total_s=100.0, policies=2, enabled=False, realtime=0.0)
    progress._bar = Bar()
    # Ticks every simulated second, then the drain after the traffic ends (capped).
    for label in ("ours", "hpa"):
        for now in (*range(1, 101), 100.0, 100.0, 100.0):
            progress(label, float(now))
    assert sum(updates) == pytest.approx(200.0)  # the bar's total: 100 s x 2 policies
    assert all(u > 0 for u in updates)


def test_simulate_reports_an_unreadable_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = cli.main(["simulate", "--trace", str(tmp_path / "missing.csv"), "--no-progress"])
    assert status == 2
    assert "cannot load traffic" in capsys.readouterr().err


def test_simulate_needs_a_traffic_source() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["simulate"])
    assert exc.value.code == 2
