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
from mlxd.protocol.messages import SamplingParams, TokenizedRequest

_SAMPLING = SamplingParams(max_tokens=8, temperature=0.0)
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


@pytest.mark.mlx
def test_a_split_chunk_waits_for_every_models_step_in_flight(smollm_tokenizer, monkeypatch):
    """Two models loaded: one's decode step runs ahead on its own stream while the pool
    steps the other, whose split prefill chunk lowers OpenBLAS's threads. The count may
    change only once the first model's stream is waited for too (``openblas.py``)."""
    import mlx.core as mx
    from mlxd.actors.engine.kernels.openblas import OpenBlas
    from mlxd.actors.engine.loading.load import load_runner

    lib = OpenBlas.loaded()
    if lib is None:
        pytest.skip("OpenBLAS is not loaded")
    before = lib.threads
    lib.set_threads(2)
    try:
        a, b = (
            load_runner(
                str(smollm_tokenizer),
                smollm_tokenizer,
                dequantize_on_cpu=True,
                max_batch=4,
                prefill_streams=2,
            )[0]
            for _ in range(2)
        )
        prompt = tuple(300 + (t * 37) % 4000 for t in range(302))
        b.start(TokenizedRequest(request_id="b", prompt_tokens=prompt[:40], sampling=_SAMPLING))
        while b.prefill("b", 64):
            pass
        b.decode()  # its next step is evaluated ahead, on b's stream
        synced = []
        synchronize = mx.synchronize
        monkeypatch.setattr(mx, "synchronize", lambda s=None: synced.append(s) or synchronize(s))
        a.start(TokenizedRequest(request_id="a", prompt_tokens=prompt, sampling=_SAMPLING))
        a.prefill("a", 200)  # two pieces: OpenBLAS gets one thread while they run
        assert lib.threads == 2
        assert any(s == b._stream for s in synced), synced
    finally:
        lib.set_threads(before)
