"""Helpers for tests that run ``mlxd serve`` as a real process: a free loopback port, and
waiting until the daemon's ``/health`` answers 200."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    base: str, alive: Callable[[], bool], timeout: float, why: Callable[[], str] = str
) -> None:
    """Poll ``base``/health until it is 200; fail (saying ``why()``) if the process dies or
    the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise AssertionError(f"mlxd exited before it was ready:\n{why()}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"mlxd not ready after {timeout:.0f} s:\n{why()}")
