"""The README's main job, ``stepscale demo``, end to end on a real vLLM CPU engine, at
its default settings: the recommendation rises during the overload, with its reason,
falls after the stabilization window, and the run ends with a summary."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROW = re.compile(r"^demo\s+(\d+)\s+(\d+)\s+(\d+)\s", re.MULTILINE)
# REPLICAS READY DESIRED, then TTFT, TTFT-MEASURED, ITL, ITL-MEASURED ("-" when unknown).
LATENCY_CELLS = re.compile(r"^demo\s+\d+\s+\d+\s+\d+\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s", re.M)
DECISION = re.compile(r"^  decision (\w+) (\d+) -> (\d+) \(advisory\): (.+)$", re.MULTILINE)
MEASURED = re.compile(r"^    measured\s+(\d+)ms\s+(\d+)ms\s+client side, (\d+) requests", re.M)


def test_demo_rises_past_the_slo_falls_back_and_summarises(tmp_path: Path) -> None:
    out = tmp_path / "status.json"
    proc = subprocess.run(
        [sys.executable, "-m", "stepscale_operator.cli", "demo", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    stdout = proc.stdout
    print(stdout)  # the whole run, for the log (pytest -rP shows it)
    assert proc.returncode == 0, stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in stdout + proc.stderr
    # The screen says what is real, what is predicted and which timings are shortened.
    assert "one real vLLM CPU engine" in stdout and "stabilization 30 s" in stdout
    assert "NAME     REPLICAS  READY  DESIRED" in stdout

    desired = [int(m.group(3)) for m in ROW.finditer(stdout)]
    assert desired, stdout[-3000:]
    peak_at = desired.index(max(desired))
    # The rise: the overload takes the recommendation above the one running engine...
    assert max(desired) >= 2, desired
    ups = [m for m in DECISION.finditer(stdout) if m.group(1) == "scale_up"]
    assert ups and all(m.group(4).strip() for m in ups)  # each with its reason
    # ... and the fall, after the overload, back to one.
    assert min(desired[peak_at:]) < max(desired) and desired[-1] == 1, desired
    assert any(m.group(1) == "scale_down" for m in DECISION.finditer(stdout))

    # Measured (the demo's own requests) beside predicted; the overload is past the SLO.
    assert "    predicted " in stdout
    measured_ttft = [int(m.group(1)) for m in MEASURED.finditer(stdout)]
    assert measured_ttft and max(measured_ttft) > 1500, measured_ttft
    # The table's -MEASURED columns are the operator's own measurement from the real
    # engine's passes (what kubectl get vd shows): the overload's queue shows there too.
    from_passes = [
        int(m.group(2).removesuffix("ms"))
        for m in LATENCY_CELLS.finditer(stdout)
        if m.group(2) != "-"
    ]
    assert from_passes and max(from_passes) > 1500, from_passes

    # The summary: decisions, model accuracy, what it would have done.
    summary = stdout[stdout.index("\nSummary\n") :]
    assert "the recommendation changed" in summary and "scale_up" in summary
    assert "prequential MAPE" in summary and "predicted vs measured p99" in summary
    assert "would have run up to" in summary and "requests on 1 real engine" in summary

    # The last status is a live one: the engine still streamed when the demo ended.
    status = json.loads(out.read_text())
    streams = status["streams"]
    assert streams["stale"] == 0 and streams["connected"] == 1
    assert streams["passes"] > 100 and streams["gaps"] == 0 and streams["malformed"] == 0
    assert status["mode"] == "advisory" and status["replicas"] == 1
    assert status["desiredReplicas"] == 1
    assert "missing" not in status["lastDecision"]["reason"]
