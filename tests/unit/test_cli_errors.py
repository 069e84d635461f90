"""Every ordinary mistake on the ``stepscale`` command line: one line naming the input
and what is expected, exit status 2, no traceback (through the real entry point)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from stepscale_operator import cli

AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        status = cli.main(argv)
    except SystemExit as exit_info:  # argparse's usage errors
        status = int(exit_info.code or 0)
    captured = capsys.readouterr()
    return status, captured.err


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["demo", "--duration-s", "0"], "--duration-s: expected a number > 0, got '0'"),
        (["demo", "--duration-s", "-5"], "--duration-s: expected a number > 0, got '-5'"),
        (["demo", "--rate-scale", "x"], "--rate-scale: expected a number > 0, got 'x'"),
        (["demo", "--phases-s", "30,40"], "--phases-s: expected three lengths > 0"),
        (["simulate", "--synthetic", "bursts", "--duration-s", "0"], "expected a number > 0"),
        (["simulate", "--synthetic", "bursts", "--duration-s", "-5"], "got '-5'"),
        (["simulate", "--synthetic", "flat", "--rate-scale", "nan"], "--rate-scale"),
        (["simulate", "--synthetic", "flat", "--policy", "dynamo@x"], "unknown policy 'dynamo@x'"),
        (["simulate", "--synthetic", "flat", "--max-replicas", "0"], "a whole number >= 1"),
        (["tail", "--count", "abc", "20380"], "--count: expected a whole number >= 1, got 'abc'"),
        (["tail", "--interval", "0", "20380"], "--interval: expected a number > 0"),
        (["tail", "host:port"], "is not tcp://HOST:PORT"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    status, err = _run(argv, capsys)
    assert status == 2
    line = _one_line_error(err)
    assert line.startswith(f"stepscale {argv[0]}: error: ") and expected in line
    assert line.endswith(f"(see stepscale {argv[0]} --help)")


@pytest.mark.parametrize("command", ["simulate", "demo"])
@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "missing.csv: No such file or directory"),
        (
            "time,prompt\n1,2\n",
            "missing columns TIMESTAMP, ContextTokens, GeneratedTokens; expected a CSV header "
            "with TIMESTAMP,ContextTokens,GeneratedTokens (found time,prompt)",
        ),
        (
            AZURE_HEADER + "2023-11-16 18:15:46.68,374,44\n2023-11-16 18:15:47.1,abc,44\n",
            "line 3: ContextTokens is 'abc'; expected a whole number >= 0",
        ),
        (
            AZURE_HEADER + "yesterday,374,44\n",
            "line 2: TIMESTAMP is 'yesterday'; expected a date and time",
        ),
        (AZURE_HEADER, "no requests"),
    ],
)
def test_unreadable_traces_are_named_with_the_line(
    command: str,
    content: str | None,
    expected: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / ("missing.csv" if content is None else "trace.csv")
    if content is not None:
        path.write_text(content)
    # The demo checks its input before it starts an engine: this returns at once.
    status, err = _run([command, "--trace", str(path)], capsys)
    assert status == 2
    line = _one_line_error(err)
    assert line.startswith(f"stepscale {command}: error: --trace {path}")
    assert expected in line


def test_mooncake_lines_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 3}\n{"timestamp": 9}\n')
    status, err = _run(["simulate", "--trace", str(path)], capsys)
    assert status == 2
    assert "line 2: missing input_length, output_length" in _one_line_error(err)


def test_an_unresolvable_tail_endpoint_fails_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    # .invalid never resolves (RFC 2606): ZMQ alone would wait for it silently.
    status, err = _run(["tail", "nonexistent.invalid:20380", "--duration", "30"], capsys)
    assert status == 2
    line = _one_line_error(err)
    assert "cannot resolve host 'nonexistent.invalid'" in line and "tcp://" in line


def test_operator_without_a_kubeconfig_is_one_line(tmp_path: Path) -> None:
    # The real console entry point in a child process, with no cluster configured.
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "KUBECONFIG": str(tmp_path / "none"),
        "PYTHONPATH": ":".join(sys.path),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "stepscale_operator.cli",
            "operator",
            "--standalone",
            "--metrics-port",
            "0",
            "--health-port",
            "0",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    line = _one_line_error(proc.stderr)
    assert line.startswith("stepscale operator: error: no Kubernetes configuration")
    assert "expected a kubeconfig" in line
