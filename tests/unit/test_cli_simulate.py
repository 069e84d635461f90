"""``stepscale simulate`` and the subcommand registry, through the real argument parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stepscale_operator import cli


def test_every_subcommand_is_registered() -> None:
    assert list(cli.SUBCOMMANDS) == ["tail", "demo", "operator", "simulate"]
    args = cli.build_parser().parse_args(["operator", "-n", "a", "-n", "b", "--standalone"])
    assert args.namespace == ["a", "b"] and args.standalone


def test_simulate_writes_a_row_per_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sim.json"
    status = cli.main(
        [
            "simulate",
            "--synthetic",
            "steps",
            "--duration-s",
            "300",
            "--policy",
            "all",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert status == 0
    payload = json.loads(out.read_text())
    runs = {r["policy"]: r for r in payload["runs"]}
    assert set(runs) == {"ours", "static", "hpa", "dynamo", "oracle"}
    assert payload["traffic"]["requests"] > 0
    # Light load for this fleet: the oracle meets the SLOs and ours is never below it.
    assert runs["oracle"]["attainment"] > 0.99
    assert runs["ours"]["gpu_hours"] >= runs["oracle"]["gpu_hours"] * 0.999
    table = capsys.readouterr().out
    assert "TTFT p99 ms" in table and table.count("synthetic-steps") == 5


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
