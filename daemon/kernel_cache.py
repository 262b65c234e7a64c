"""Where MLX keeps the GPU kernels it compiles, so a restart does not compile them again.

MLX's CUDA backend compiles kernels at first use with NVRTC: every graph
``mx.compile`` fuses, the gather / slicing / indexing kernels, and the quantized
matmuls (``qmm_sm80`` / ``qmm_sm90``, CUTLASS templates; what a 4-bit model runs
most). It keeps the result as PTX files in ``$MLX_PTX_CACHE_DIR``, by default
``<temp dir>/mlx/<version>/ptx``. A temp directory is emptied at reboot, and a
systemd service with ``PrivateTmp`` gets a fresh one at every start, so there the
whole compile (~50 s on the first request of an H200 process, issue 30's probe) is
paid again at every restart. mlxd points MLX at a cache under the user's cache
directory instead (``engine.kernel_cache_dir``), unless the environment already
names one. Kernels written with ``mx.fast.*_kernel`` are never cached by MLX.
On the CPU backend and Metal the variable is unused. Plain Python, no MLX import:
it must run before MLX compiles its first kernel.
"""

from __future__ import annotations

import os
from pathlib import Path

VARIABLE = "MLX_PTX_CACHE_DIR"


def default_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlxd" / "mlx-kernels"


def use(setting: str) -> str:
    """Point MLX's kernel cache at ``setting`` ("auto": ``default_dir()``; "": MLX's own
    default); the environment's own ``MLX_PTX_CACHE_DIR`` wins. Returns a log line."""
    if os.environ.get(VARIABLE):
        return f"MLX kernel cache: {os.environ[VARIABLE]} (from the environment)"
    if not setting:
        return "MLX kernel cache: MLX's default (the temp directory)"
    where = default_dir() if setting == "auto" else Path(setting).expanduser()
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # an unwritable cache costs start-up time, never the start
        return f"MLX kernel cache: {where} cannot be created ({exc}); MLX's default is used"
    os.environ[VARIABLE] = str(where)
    return f"MLX kernel cache: {where}"
