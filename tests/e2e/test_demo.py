"""The README's main job, ``stepscale demo``, end to end on a real vLLM CPU engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_demo_runs_the_whole_loop(tmp_path: Path) -> None:
    out = tmp_path / "status.json"
    proc = subprocess.run(
        [sys.executable, "-m", "stepscale_operator.cli", "demo", "--duration-s", "20",
         "--refresh-s", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # The live view shows the kubectl-style columns and a decision with a reason.
    assert "NAME     REPLICAS  READY  DESIRED" in proc.stdout
    assert "decision" in proc.stdout and "(advisory)" in proc.stdout
    # The file holds the VllmDeployment status the operator would write.
    status = json.loads(out.read_text())
    streams = status["streams"]
    assert streams["passes"] > 100 and streams["gaps"] == 0 and streams["malformed"] == 0
    assert status["costModel"]["samples"] > 0
    assert "step_ms =" in status["costModel"]["formula"]
    assert status["mode"] == "advisory" and status["replicas"] == 1
    # Once the engine is gone its stream is missing: the planner holds.
    assert status["lastDecision"]["action"] == "hold"
    assert "missing" in status["lastDecision"]["reason"]
