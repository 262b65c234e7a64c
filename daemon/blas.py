"""OpenBLAS fast path for MLX's CPU backend on Linux.

The ``mlx[cpu]`` wheel carries a slow reference BLAS; loading OpenBLAS first
(``LD_PRELOAD``) makes float32 matmul ~80x faster. The dynamic loader reads
``LD_PRELOAD`` only at process start, so the launcher re-executes itself once
with it set. No MLX import here: this must run before MLX is loaded.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_MARK = "MLXD_BLAS_CHECKED"


def find_openblas() -> str | None:
    return next((p for p in OPENBLAS_CANDIDATES if Path(p).exists()), None)


def status() -> str:
    """One line for the log: which BLAS MLX's CPU backend will use."""
    if sys.platform != "linux":
        return "BLAS: platform default"
    lib = find_openblas()
    if lib and lib in os.environ.get("LD_PRELOAD", ""):
        return f"BLAS: OpenBLAS preloaded ({lib}) - fast CPU matmul"
    return "BLAS: MLX's reference BLAS (slow); install libopenblas0-pthread for ~80x faster matmul"


def reexec_with_openblas(module: str = "mlxd.daemon.cli") -> None:
    """Re-exec ``python -m module`` with OpenBLAS preloaded, once, when it exists on Linux."""
    if sys.platform != "linux" or os.environ.get(_MARK):
        return
    lib = find_openblas()
    env = dict(os.environ, **{_MARK: "1"})
    if lib is None or lib in env.get("LD_PRELOAD", ""):
        os.environ[_MARK] = "1"
        return
    env["LD_PRELOAD"] = ":".join(filter(None, [lib, env.get("LD_PRELOAD")]))
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], env)


def set_threads(wanted: int) -> str | None:
    """Give OpenBLAS ``wanted`` threads (0: leave its default, one per core) and return a
    line for the log, or None when OpenBLAS is not loaded. See ``actors/engine/kernels/openblas.py``
    for how the runner lowers the count while a prefill chunk runs split over streams."""
    from mlxd.actors.engine.kernels.openblas import OpenBlas

    lib = OpenBlas.loaded()
    if lib is None:
        return None
    if wanted > 0:
        lib.set_threads(wanted)
    return f"OpenBLAS threads: {lib.threads} (engine.blas_threads = {wanted})"
