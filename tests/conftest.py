"""Shared fixtures: free loopback ports and where the shared folder lives."""

from __future__ import annotations

import importlib.util
import random
import socket
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_DIR = REPO_ROOT.parent / "shared"


def benchmark_module(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (loaded once), its folder importable as
    the benchmarks import each other."""
    if name in sys.modules:
        return sys.modules[name]
    folder = str(REPO_ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_tcp_port(count: int = 1) -> int:
    """The first of ``count`` consecutive loopback TCP ports that nothing listens on now.

    The ports lie below the kernel's ephemeral range. A subscriber that keeps
    reconnecting to a loopback port nobody has bound yet (the collectors start
    before the engine) can otherwise draw that very port as its own source port
    and connect to itself, which takes the port from the publisher (a CI run
    lost a data-parallel rank's stream this way).
    """
    low = _ephemeral_ports_start()
    rng = random.Random()
    for _ in range(1000):
        base = rng.randrange(10000, low - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free TCP ports below {low}")


@pytest.fixture
def tcp_port() -> int:
    """A free loopback TCP port."""
    return free_tcp_port()
