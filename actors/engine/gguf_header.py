"""A bounds check of a GGUF file's header before MLX reads it.

``mx.load`` trusts the counts and lengths in a GGUF header: a truncated or
corrupt file can make it read past the end of the file and crash the process
(SIGSEGV) instead of raising. ``check_gguf`` walks the header (metadata and
tensor infos) with every count, length and tensor extent checked against the
file size, so such a file is a one-line start-up error. Plain Python over an
``mmap``: no MLX, and only the header's pages are read.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
# ggml type → (elements per block, bytes per block), for the types MLX and common GGUFs use
_BLOCKS = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    30: (1, 2),  # BF16
}


class GGUFError(ValueError):
    """The file is not a well-formed GGUF file."""


class _Reader:
    def __init__(self, data: mmap.mmap | bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise GGUFError(f"truncated or corrupt header (needs {n} bytes at offset {self.pos})")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def uint(self, size: int) -> int:
        return int.from_bytes(self.take(size), "little")

    def string(self) -> bytes:
        return self.take(self.uint(8))

    def value(self, kind: int) -> object:
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise GGUFError(f"unknown metadata value type {kind} at offset {self.pos}")
        item, count = self.uint(4), self.uint(8)
        if item in _SCALARS:  # fixed-size items: one bounds check for the whole array
            return self.take(count * _SCALARS[item])
        if count > len(self.data) - self.pos:  # every item takes at least one byte
            raise GGUFError(f"array of {count} items at offset {self.pos} exceeds the file")
        for _ in range(count):
            self.value(item)
        return None


def check_gguf(path: Path) -> None:
    """Raise ``GGUFError`` unless the header and every tensor's extent fit in the file."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _check(_Reader(data))


def _check(r: _Reader) -> None:
    if r.take(4) != b"GGUF":
        raise GGUFError("not a GGUF file (no GGUF magic)")
    version = r.uint(4)
    if version not in (2, 3):
        raise GGUFError(f"unsupported GGUF version {version}")
    tensors, entries = r.uint(8), r.uint(8)
    alignment = 32
    for _ in range(entries):
        key, kind = r.string(), r.uint(4)
        value = r.value(kind)
        if key == b"general.alignment" and isinstance(value, bytes) and len(value) == 4:
            alignment = struct.unpack("<I", value)[0] or 32
    extents = [_tensor_extent(r) for _ in range(tensors)]
    start = -(-r.pos // alignment) * alignment
    for name, offset, size in extents:
        if start + offset + size > len(r.data):
            raise GGUFError(f"tensor {name!r} extends past the end of the file (truncated?)")


def _tensor_extent(r: _Reader) -> tuple[str, int, int]:
    name = r.string().decode(errors="replace")
    n_dims = r.uint(4)
    if n_dims > _MAX_DIMS:
        raise GGUFError(f"tensor {name!r} has {n_dims} dimensions")
    elements = 1
    for _ in range(n_dims):
        elements *= r.uint(8)
    kind, offset = r.uint(4), r.uint(8)
    per_block, block_bytes = _BLOCKS.get(kind, (1, 0))  # unknown type: only its offset
    return name, offset, -(-elements // per_block) * block_bytes
