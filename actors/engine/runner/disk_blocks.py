"""The disk tier's blocks: attention KV cut into fixed-size token blocks, content-addressed.

The snapshots of a growing conversation share their leading tokens, and the attention KV
of those tokens is the same bytes in each. So a snapshot is stored as what is its own
(SSM / GatedDeltaNet state, sliding windows, every array that is not append-only KV, and
the partial last block of the KV) plus the names of the full blocks it uses; a block is
a file of its own, written once however many snapshots use it.

A block's key is a hash chain over the tokens up to its end, seeded with the space (model,
adapter, template, ``kv_bits``) and the layout of the KV arrays, so block ``i`` of two
snapshots is one file exactly when they share their first ``(i + 1) * block_tokens``
tokens. (Two computations of the same prefix may differ in the last bits; a snapshot then
reads back the first one's, which serves the same tokens as a RAM hit on a snapshot
another request made does.)

No mlx and no files here: the layout comes from the layer tree ``disk_codec`` made (array
nodes ``{"a": dtype, "s": shape, "o": offset, "n": bytes}``; ``"b": axis`` marks
append-only KV whose ``axis`` is the token axis, with a row per token from 0), and bytes
are cut and joined with numpy on the I/O thread. A KV array's rows past the snapshot's
tokens (capacity a cache allocated ahead) are not stored: such a layer reads back with
its buffer cut at its ``offset``, which it never reads past.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class _Kv:
    """One append-only KV array as rows: ``outer`` x ``rows`` x ``row_bytes``."""

    outer: int
    rows: int
    row_bytes: int

    @classmethod
    def of(cls, node: dict[str, Any]) -> _Kv:
        shape, axis, n = node["s"], int(node["b"]), int(node["n"])
        outer, rows = math.prod(shape[:axis]), int(shape[axis])
        if outer * rows == 0 or n % (outer * rows):
            raise ValueError(f"a KV array of {n} bytes does not have shape {shape}")
        return cls(outer, rows, n // (outer * rows))

    def view(self, buffer: Any, rows: int | None = None) -> np.ndarray:
        r = self.rows if rows is None else rows
        return np.frombuffer(buffer, dtype=np.uint8).reshape(self.outer, r, self.row_bytes)


def array_nodes(layers: list[Any]) -> list[dict[str, Any]]:
    """The array nodes holding bytes, in payload order (the order ``encode`` wrote them)."""
    found: list[dict[str, Any]] = []

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            if "a" in x:
                if int(x["n"]):
                    found.append(x)
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(layers)
    return sorted(found, key=lambda node: int(node["o"]))


@dataclass
class Split:
    """One snapshot cut for the disk: ``layers`` as it reads back (offsets into the
    assembled payload), ``own`` (the snapshot file's payload, in pieces) and its blocks."""

    layers: list[Any]
    own: list[Any]
    own_bytes: int
    keys: list[str]
    block_bytes: int
    _kv: list[tuple[_Kv, np.ndarray]]
    _block_tokens: int

    def block(self, i: int) -> list[np.ndarray]:
        """Block ``i``'s bytes, in pieces (each KV array's rows of the block)."""
        lo, hi = i * self._block_tokens, (i + 1) * self._block_tokens
        return [np.ascontiguousarray(rows[:, lo:hi, :]) for _, rows in self._kv]


def split(
    layers: list[Any], buffers: Sequence[Any], tokens: Sequence[int], block_tokens: int, seed: str
) -> Split:
    """Cut a snapshot's arrays (``buffers``, one per array node in payload order) into its
    own payload and full blocks of ``block_tokens`` tokens (0: no blocks, stored whole).
    ``seed``: the space's name (blocks are never shared across spaces)."""
    layers = copy.deepcopy(layers)
    nodes = array_nodes(layers)
    if len(nodes) != len(buffers):
        raise ValueError("a snapshot's buffers do not match its layer tree")
    n_tokens = len(tokens)
    for node in nodes:  # only KV with a row for every token can be cut at the tokens
        if "b" in node and (not block_tokens or int(node["s"][int(node["b"])]) < n_tokens):
            del node["b"]
    kv = [node for node in nodes if "b" in node]
    n_blocks = n_tokens // block_tokens if kv and block_tokens else 0
    own: list[Any] = []
    cut: list[tuple[_Kv, np.ndarray]] = []
    offset = 0
    for node, buffer in zip(nodes, buffers, strict=True):
        if "b" in node:
            shape = _Kv.of(node)
            rows = shape.view(buffer)[:, :n_tokens, :]
            node["s"][int(node["b"])] = n_tokens
            node["n"] = shape.outer * n_tokens * shape.row_bytes
            cut.append((_Kv(shape.outer, n_tokens, shape.row_bytes), rows))
            own.append(np.ascontiguousarray(rows[:, n_blocks * block_tokens :, :]))
        else:
            own.append(buffer)
        node["o"] = offset
        offset += int(node["n"])
    block_bytes = sum(s.outer * block_tokens * s.row_bytes for s, _ in cut) if n_blocks else 0
    own_bytes = sum(memoryview(p).nbytes for p in own)
    keys = block_keys(tokens, block_tokens, n_blocks, seed, kv)
    return Split(layers, own, own_bytes, keys, block_bytes, cut, block_tokens)


def block_keys(
    tokens: Sequence[int], block_tokens: int, n_blocks: int, seed: str, kv: list[dict[str, Any]]
) -> list[str]:
    """The hash chain: key ``i`` covers the seed, the KV layout and ``tokens[:(i+1)*B]``."""
    layout = [[n["a"], [d for j, d in enumerate(n["s"]) if j != int(n["b"])]] for n in kv]
    h = hashlib.sha256(json.dumps([seed, block_tokens, layout]).encode()).digest()
    keys = []
    for i in range(n_blocks):
        chunk = np.asarray(tokens[i * block_tokens : (i + 1) * block_tokens], dtype=np.int64)
        h = hashlib.sha256(h + chunk.tobytes()).digest()
        keys.append(h.hex()[:32])
    return keys


def sizes(layers: list[Any], n_blocks: int, block_tokens: int) -> tuple[int, int, int]:
    """What a stored snapshot's parts must measure: its own payload, each block, and the
    assembled payload (ValueError: the tree does not describe such a snapshot)."""
    own = block = total = 0
    for node in array_nodes(layers):
        n = int(node["n"])
        if int(node["o"]) != total:
            raise ValueError("the arrays are not laid out end to end")
        total += n
        if "b" not in node:
            own += n
            continue
        shape = _Kv.of(node)
        if shape.rows < n_blocks * block_tokens:
            raise ValueError("a KV array is shorter than its blocks")
        block += shape.outer * block_tokens * shape.row_bytes
        own += n - shape.outer * n_blocks * block_tokens * shape.row_bytes
    return own, (block if n_blocks else 0), total


def assemble(
    layers: list[Any], own: memoryview, blocks: Sequence[memoryview], block_tokens: int
) -> bytearray:
    """The payload ``layers`` describes, from the snapshot's own bytes and its blocks
    (ValueError: a part has the wrong length)."""
    own_bytes, block_bytes, total = sizes(layers, len(blocks), block_tokens)
    if len(own) != own_bytes or any(len(b) != block_bytes for b in blocks):
        raise ValueError("a snapshot's parts do not have the lengths its header says")
    out = bytearray(total)
    at = in_block = 0
    for node in array_nodes(layers):
        o, n = int(node["o"]), int(node["n"])
        if "b" not in node:
            out[o : o + n] = own[at : at + n]
            at += n
            continue
        shape = _Kv.of(node)
        dst = shape.view(memoryview(out)[o : o + n])
        piece = shape.outer * block_tokens * shape.row_bytes
        for i, block in enumerate(blocks):
            rows = shape.view(block[in_block : in_block + piece], block_tokens)
            dst[:, i * block_tokens : (i + 1) * block_tokens, :] = rows
        tail = shape.rows - len(blocks) * block_tokens
        size = shape.outer * tail * shape.row_bytes
        dst[:, shape.rows - tail :, :] = shape.view(own[at : at + size], tail)
        at += size
        in_block += piece
    return out
