"""Run ingest tests on the native fast path and on the pure-Python fallback."""

from __future__ import annotations

import os

import pytest

from stepscale_operator import fpm_native

IN_CI = bool(os.environ.get("CI"))


def use_receive_path(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``native``: the C extension (skipped where it is not built, failed under CI);
    ``pure-python``: the extension hidden, as on a machine without a compiler."""
    if path == "native":
        if not (fpm_native.AVAILABLE and fpm_native.DRAIN_AVAILABLE):
            reason = "the native FPM extension is not built (no C compiler at install?)"
            if IN_CI:
                pytest.fail(f"{reason}; CI is set: it must be built")
            pytest.skip(reason)
        return
    monkeypatch.setattr(fpm_native, "AVAILABLE", False)
    monkeypatch.setattr(fpm_native, "DRAIN_AVAILABLE", False)
    monkeypatch.setattr(fpm_native, "_native", None)
