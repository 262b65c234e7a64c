"""OpenBLAS threads (``daemon/blas.py``, ``engine.blas_threads``): set through OpenBLAS's own
C API when OpenBLAS is loaded, a log line saying how many; nothing (None) where it is not,
as on macOS or without ``libopenblas0-pthread``. Run in subprocesses so the test process's
own OpenBLAS keeps its thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mlxd.daemon import blas

SCRIPT = (
    "import sys; from mlxd.daemon import blas\n"
    "for wanted in sys.argv[1:]:\n"
    "    print(blas.set_threads(int(wanted)))\n"
)


def run(env: dict[str, str], *wanted: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *wanted],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout.splitlines()


@pytest.mark.skipif(blas.find_openblas() is None, reason="OpenBLAS is not installed")
def test_threads_are_set_when_openblas_is_loaded():
    env = dict(os.environ, LD_PRELOAD=blas.find_openblas(), OPENBLAS_NUM_THREADS="2")
    assert run(env, "0", "1", "0", "2") == [
        "OpenBLAS threads: 2 (engine.blas_threads = 0)",  # 0 leaves the count as it is
        "OpenBLAS threads: 1 (engine.blas_threads = 1)",
        "OpenBLAS threads: 1 (engine.blas_threads = 0)",
        "OpenBLAS threads: 2 (engine.blas_threads = 2)",
    ]


def test_nothing_without_openblas():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    assert run(env, "1") == ["None"]
