"""Prefix cache, disk tier: snapshots spilled from RAM, kept in files under a byte budget.

A sync core with no mlx: ``disk_codec`` turns a snapshot into a JSON-able layer tree
plus raw buffers on the engine thread (and back); this module owns the files, their
index and one I/O thread, so no file is read or written on the engine thread.

- Layout: ``<root>/<slug>-<space hash>/<token hash>.kv`` (snapshots) and ``<key>.blk``
  (blocks). A *space* is everything that
  changes a snapshot's bytes (model files, adapter, chat template, KV quantization,
  cache layout, ``FORMAT_VERSION``), hashed; ``slug`` is the served model's id. At
  start-up every space of a model that is not configured, and every file that is not a
  well-formed file of this format, is deleted; when a model loads, the other spaces of
  its slug (its earlier files, templates, ``kv_bits``) are deleted.
- Blocks (``disk_blocks``): attention KV is stored in blocks of ``block_tokens`` tokens,
  content-addressed by a hash chain over the tokens, each written once however many
  snapshots use it; a snapshot file holds the rest (SSM state, sliding windows, the
  partial last block) and the keys of its blocks. A block is counted in the budget once
  and deleted when no snapshot names it; the index rebuilt at start-up counts the names
  again, deletes blocks none names (a crash between a block and its snapshot) and
  snapshots whose blocks are missing.
- Snapshot file: ``MAGIC``, header length, header CRC-32, the JSON header (space,
  tokens, trimmable, layer tree, block keys, payload length and CRC-32), the payload.
  Block file: ``BLOCK_MAGIC``, its key, payload length and CRC-32, the payload. Each is
  written to a temporary file, fsynced, renamed, directory fsynced (blocks before the
  snapshot that names them): a reader sees a whole file or none. A file whose size,
  header or checksum is wrong is deleted and counted (``corrupt_removed``), and so is
  every snapshot naming a bad block: a miss, never served.
- Write-behind (``write_behind_s`` > 0): every snapshot the RAM tier makes is written
  at most that long after it was made, so a ``kill -9`` loses at most that much. A
  snapshot waits in ``_held`` until then; a longer trimmable one of the same
  conversation made meanwhile replaces it (``coalesced``); the bytes waiting stay
  under ``max_pending_bytes`` (past it a snapshot is not queued: ``spills_dropped``,
  and it still goes to disk if RAM evicts it later). A clock thread hands due
  snapshots to the I/O thread; nothing waits for a write.
- Budget: the files never take more than ``max_bytes`` (room is made, least recently
  used first across all spaces, before a file is written; the index rebuilt at start-up
  is trimmed the same way). Use is the file's mtime, so the order survives restarts.
- A write that fails (disk full, a directory that cannot be written) turns writes off
  with one log line: the cache goes on in RAM only, no request fails.
- One process owns a directory: ``LOCK`` is held with ``flock`` while the store lives
  (the kernel releases it when the process ends, ``kill -9`` included). A second
  daemon given the same ``disk_dir`` (a service and a hand-started ``mlxd serve``) would
  delete the first one's files at start-up and overrun the shared budget; instead it
  leaves the directory alone and keeps its prefix cache in RAM, with one log line that
  names the owner's pid.
- Matching mirrors the RAM tier: a trimmable snapshot serves any common prefix, an
  exact-length one (SSM / ArraysCache state) only prompts it is a whole prefix of.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxd.actors.engine.runner import disk_blocks
from mlxd.actors.engine.runner.prefix_cache import _common_prefix, block_hashes
from mlxd.protocol.messages import DiskCounters

log = logging.getLogger("mlxd.disk_cache")

FORMAT_VERSION = 2  # 2: attention KV in content-addressed blocks
MAGIC = b"MLXDKV\x00\x02"
BLOCK_MAGIC = b"MLXDBK\x00\x02"
_HEAD = struct.Struct("<8sQI")  # magic, header length, header crc32
_BLOCK_HEAD = struct.Struct("<8s32sQI")  # magic, key, payload length, payload crc32
SUFFIX = ".kv"
BLOCK_SUFFIX = ".blk"
_TEMP = ".tmp"
_SPACE_NAME = re.compile(r"^(?P<slug>[A-Za-z0-9_.-]{1,64})-(?P<hash>[0-9a-f]{20})$")
_BLOCK_NAME = re.compile(r"^[0-9a-f]{32}$")
_BLOCK = 64  # the disk index's own block size (any size gives the same matches)
LOCK = "LOCK"  # the owner's lock file in the root (its pid inside)


def slug(model_id: str) -> str:
    """A model id as a directory name (``""``: the default model)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_id or "default").strip("._")
    return (cleaned or "default")[:64]


def adapter_slug(model_slug: str, adapter: str) -> str:
    """The directory name of a LoRA adapter's snapshots over the model ``model_slug``."""
    return slug(f"{model_slug}.lora.{adapter}")


def space_name(model_slug: str, key: dict[str, Any]) -> str:
    """The directory of one space: the model's slug and the hash of its key."""
    canonical = json.dumps({**key, "format": FORMAT_VERSION}, sort_keys=True)
    return f"{model_slug}-{hashlib.sha256(canonical.encode()).hexdigest()[:20]}"


def files_fingerprint(path: Path | None) -> list[list[Any]]:
    """Names, sizes and mtimes of a file or of a directory's files (recursively)."""
    if path is None:
        return []
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    out = []
    for p in files:
        st = p.stat()
        out.append([str(p.relative_to(path) if p != path else p.name), st.st_size, st.st_mtime_ns])
    return out


@dataclass(frozen=True)
class Encoded:
    """A snapshot ready to write: its layer tree and the buffers the tree's offsets
    point into (objects with the buffer protocol; they keep their arrays alive). Array
    nodes with ``"b"`` are append-only KV (``disk_blocks``)."""

    layers: list[Any]
    buffers: list[Any]
    nbytes: int


@dataclass
class DiskEntry:
    path: Path
    space: str
    tokens: tuple[int, ...]
    trimmable: bool
    size: int
    used: float
    blocks: tuple[str, ...] = ()  # the keys of the blocks it names


@dataclass
class _Block:
    path: Path
    size: int
    refs: int = 0  # snapshots naming it


@dataclass(frozen=True)
class Loaded:
    """A file read back and verified: its header (``layers``) and its payload."""

    entry: DiskEntry
    layers: list[Any]
    payload: memoryview


@dataclass
class _Held:
    """A snapshot waiting to be written behind (until ``due``, monotonic seconds)."""

    space: str
    tokens: tuple[int, ...]
    trimmable: bool
    enc: Encoded
    due: float

    def covers(self, space: str, tokens: tuple[int, ...], trimmable: bool) -> bool:
        if space != self.space:
            return False
        if tokens == self.tokens:
            return True
        n = len(tokens)
        return trimmable and self.trimmable and len(self.tokens) > n and self.tokens[:n] == tokens


class _Space:
    """One space's entries with a block index, as the RAM tier matches them, and the
    blocks its entries name."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], DiskEntry] = {}
        self.by_block: dict[int, set[tuple[int, ...]]] = {}
        self.short: set[tuple[int, ...]] = set()
        self.blocks: dict[str, _Block] = {}

    def add(self, entry: DiskEntry) -> None:
        self.entries[entry.tokens] = entry
        hashes = block_hashes(entry.tokens, _BLOCK)
        for h in hashes:
            self.by_block.setdefault(h, set()).add(entry.tokens)
        if not hashes:
            self.short.add(entry.tokens)

    def remove(self, tokens: tuple[int, ...]) -> DiskEntry | None:
        entry = self.entries.pop(tokens, None)
        for h in block_hashes(tokens, _BLOCK):
            keys = self.by_block.get(h)
            if keys is not None:
                keys.discard(tokens)
                if not keys:
                    del self.by_block[h]
        self.short.discard(tokens)
        return entry

    def candidates(self, prompt: Sequence[int]) -> set[tuple[int, ...]]:
        found = set(self.short)
        for h in block_hashes(prompt, _BLOCK):
            keys = self.by_block.get(h)
            if not keys:
                break
            found |= keys
        return found

    def best(self, prompt: Sequence[int], limit: int) -> tuple[DiskEntry, int] | None:
        best: tuple[DiskEntry, int] | None = None
        for key in self.candidates(prompt):
            entry = self.entries[key]
            shared = min(_common_prefix(key, prompt, 0), limit)
            usable = shared if entry.trimmable else (len(key) if shared == len(key) else 0)
            if usable and (best is None or usable > best[1]):
                best = (entry, usable)
        return best

    def covers(self, tokens: tuple[int, ...], trimmable: bool) -> bool:
        """Whether a file already serves everything a snapshot of ``tokens`` would."""
        if tokens in self.entries:
            return True
        if not trimmable:
            return False
        return any(
            e.trimmable and len(k) > len(tokens) and k[: len(tokens)] == tokens
            for k in self.candidates(tokens)
            if (e := self.entries[k])
        )


class DiskStore:
    """Every space's files under ``root``, one I/O thread, one byte budget.

    ``models``: the slugs of the configured models (spaces of any other are deleted at
    start-up). ``max_pending_bytes``: snapshots waiting for the I/O thread (spilled or
    held for write-behind); past it a snapshot is not queued (counted), so the queue
    never holds more memory. ``write_behind_s``: every snapshot the RAM tier makes is
    written at most this long after (0: only spills, i.e. evictions, unloads and
    shutdown). ``block_tokens``: the size of the attention-KV blocks (0: whole snapshots).
    """

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        models: Iterable[str],
        *,
        max_pending_bytes: int = 1 << 30,
        write_behind_s: float = 0.0,
        block_tokens: int = 256,
        fsync: bool = True,
    ):
        self.root = Path(root).expanduser()
        self.max_bytes = max_bytes
        self.models = set(models)
        self.max_pending_bytes = max_pending_bytes
        self.write_behind_s = write_behind_s
        self.block_tokens = block_tokens
        self.fsync = fsync
        self.stats = DiskCounters(enabled=True, writable=True, max_bytes=max_bytes)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # the write-behind clock's
        self._spaces: dict[str, _Space] = {}
        self._pending = 0  # bytes spilled or held, not yet written
        self._held: dict[tuple[str, tuple[int, ...]], _Held] = {}
        self._pinned: set[str] = set()  # blocks the write in progress names
        self._closing = False
        self._doomed: list[Path] = []  # files dropped from the index, to delete unlocked
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxd-disk")
        self._lock_fd: int | None = None
        self.owner_pid = 0  # another process holding the directory (0: none, or us)
        self.scanned: Future[None] = self._io.submit(self._scan)
        if write_behind_s > 0:
            clock = threading.Thread(target=self._clock, name="mlxd-disk-behind", daemon=True)
            clock.start()

    # ---- the engine thread's side -------------------------------------------------

    def space(self, model_slug: str, key: dict[str, Any]) -> DiskView:
        """A loaded model's view; its slug's other spaces are deleted (on the I/O thread)."""
        name = space_name(model_slug, key)
        self._io.submit(self._drop_siblings, model_slug, name)
        return DiskView(self, name)

    def best(self, space: str, prompt: Sequence[int], limit: int) -> tuple[DiskEntry, int] | None:
        with self._lock:
            s = self._spaces.get(space)
            return s.best(prompt, limit) if s is not None else None

    def read(self, entry: DiskEntry) -> Future[Loaded | None]:
        return self._io.submit(self._read, entry)

    def spill(
        self,
        space: str,
        tokens: tuple[int, ...],
        trimmable: bool,
        enc: Encoded,
        *,
        behind: bool = False,
    ) -> bool:
        """Queue a snapshot for writing, now or (``behind``) within ``write_behind_s``;
        False (counted) if writes are off or the queue is full."""
        with self._lock:
            s = self._spaces.get(space)
            if s is not None and s.covers(tokens, trimmable):
                return True
            if any(h.covers(space, tokens, trimmable) for h in self._held.values()):
                self.stats.coalesced += 1  # written with the longer one
                return True
            if not self.stats.writable or self._pending + enc.nbytes > self.max_pending_bytes:
                self.stats.spills_dropped += 1
                return False
            self._pending += enc.nbytes
            self.stats.pending_writes += 1
            if behind and self.write_behind_s > 0:
                due = self._coalesce(space, tokens, trimmable)
                self._held[(space, tokens)] = _Held(space, tokens, trimmable, enc, due)
                self._wake.notify()
                return True
        self._io.submit(self._write, space, tokens, trimmable, enc)
        return True

    def _coalesce(self, space: str, tokens: tuple[int, ...], trimmable: bool) -> float:
        """Drop the held snapshots a trimmable one of ``tokens`` serves (shorter ones of the
        same conversation); its deadline is the earliest of theirs (under the lock)."""
        due = time.monotonic() + self.write_behind_s
        if not trimmable:
            return due
        for key, held in list(self._held.items()):
            n = len(held.tokens)
            if held.space == space and held.trimmable and tokens[:n] == held.tokens:
                self._drop_held(key)
                self.stats.coalesced += 1
                due = min(due, held.due)
        return due

    def discard(self, entry: DiskEntry) -> None:
        """A file whose contents could not be made into a snapshot: delete it (counted)."""
        self._io.submit(self._discard, entry)

    def clear(self, space: str | None = None) -> Future[None]:
        """Delete every file of ``space`` (of every space when None), and the snapshots
        held for it; writes come back on."""
        with self._lock:
            for key, held in list(self._held.items()):
                if space is None or held.space == space:
                    self._drop_held(key)
        return self._io.submit(self._clear, space)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far, held snapshots included, has been written."""
        self._release_held(everything=True)
        self._io.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """Write what is held, stop the threads, release the directory."""
        self._release_held(everything=True)
        with self._lock:
            self._closing = True
            self._wake.notify()
        self._io.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    @property
    def owned(self) -> bool:
        """False: another process holds the directory; this store does nothing (known
        once ``scanned`` is done)."""
        return self.owner_pid == 0

    def counters(self) -> DiskCounters:
        with self._lock:
            return DiskCounters(**{f: getattr(self.stats, f) for f in self.stats.__struct_fields__})

    # ---- write-behind --------------------------------------------------------------

    def _clock(self) -> None:
        """Hand each held snapshot to the I/O thread when it is due (its own thread: it
        only waits, the I/O thread reads and writes)."""
        with self._lock:
            while not self._closing:
                now = time.monotonic()
                due = min((h.due for h in self._held.values()), default=None)
                if due is None or due > now:
                    self._wake.wait(None if due is None else due - now)
                    continue
                self._submit_held([k for k, h in self._held.items() if h.due <= now])

    def _release_held(self, everything: bool) -> None:
        with self._lock:
            now = time.monotonic()
            self._submit_held([k for k, h in self._held.items() if everything or h.due <= now])

    def _submit_held(self, keys: list[tuple[str, tuple[int, ...]]]) -> None:
        """Queue held snapshots for the I/O thread, oldest first (under the lock)."""
        for key in sorted(keys, key=lambda k: self._held[k].due):
            h = self._held.pop(key)
            self._io.submit(self._write, h.space, h.tokens, h.trimmable, h.enc)

    def _drop_held(self, key: tuple[str, tuple[int, ...]]) -> None:
        held = self._held.pop(key)
        self._pending -= held.enc.nbytes
        self.stats.pending_writes -= 1

    # ---- the I/O thread ---------------------------------------------------------------

    def _own_directory(self) -> bool:
        """Take ``LOCK`` (False: another live process holds it). A directory that cannot
        be created or locked (read-only) goes on unlocked: the scan turns writes off."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                return True  # no locking on this file system: go on as before
            try:
                self.owner_pid = int(os.pread(fd, 32, 0).decode().strip() or 0) or -1
            except (OSError, ValueError):
                self.owner_pid = -1
            os.close(fd)
            log.warning(
                "prefix cache on disk: %s is in use by another process (pid %s); "
                "this daemon keeps its prefix cache in RAM only",
                self.root,
                self.owner_pid if self.owner_pid > 0 else "unknown",
            )
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd
        return True

    def _scan(self) -> None:
        """Take the directory, rebuild the index from the files, delete what is not
        ours, then fit the budget."""
        if not self._own_directory():
            self.stats.enabled = self.stats.writable = False
            self.stats.owner_pid = self.owner_pid
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            children = list(self.root.iterdir())
        except OSError as exc:
            self._writes_off(exc)
            return
        for child in children:
            if child.name == LOCK:
                continue
            match = _SPACE_NAME.match(child.name)
            if not child.is_dir() or match is None or match["slug"] not in self.models:
                self.stats.incompatible_removed += _remove_tree(child)
                continue
            self._index_space(child)
        with self._lock:
            self._fit(0)
        self._sweep()
        self._probe_writable()
        log.info(
            "prefix cache on disk: %d snapshots, %d blocks, %.0f MiB of %.0f MiB in %s",
            self.stats.entries,
            self.stats.blocks,
            self.stats.bytes / 2**20,
            self.max_bytes / 2**20,
            self.root,
        )

    def _index_space(self, directory: Path) -> None:
        """Blocks first, then the snapshots naming them; blocks none names go (a crash
        between writing a block and the snapshot naming it)."""
        paths = sorted(directory.iterdir(), key=lambda p: p.suffix != BLOCK_SUFFIX)
        for path in paths:
            if path.suffix == BLOCK_SUFFIX and path.is_file():
                self._index_block(directory.name, path)
            else:
                self._index_file(directory.name, path)
        with self._lock:
            space = self._spaces.get(directory.name)
            orphans = [k for k, b in space.blocks.items() if not b.refs] if space else []
            for key in orphans:
                self._drop_block(space, key)
                self.stats.torn_removed += 1

    def _index_block(self, space: str, path: Path) -> None:
        size = _block_size(path)
        if size is None:
            _unlink(path)
            self.stats.corrupt_removed += 1
            return
        with self._lock:
            self._spaces.setdefault(space, _Space()).blocks[path.stem] = _Block(path, size)
            self.stats.bytes += size
            self.stats.blocks += 1

    def _probe_writable(self) -> None:
        probe = self.root / f"probe{_TEMP}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            self._writes_off(exc)

    def _index_file(self, space: str, path: Path) -> None:
        if path.suffix != SUFFIX or not path.is_file():
            _unlink(path)  # a temporary file a crash left behind, or not ours
            self.stats.torn_removed += 1
            return
        header, size = _read_header(path)
        if header is None:
            _unlink(path)
            self.stats.corrupt_removed += 1
            return
        if header.get("format") != FORMAT_VERSION or header.get("space") != space:
            _unlink(path)
            self.stats.incompatible_removed += 1
            return
        blocks = tuple(header["blocks"])
        entry = DiskEntry(
            path, space, tuple(header["tokens"]), bool(header["trimmable"]), size, 0.0, blocks
        )
        entry.used = path.stat().st_mtime
        block_size = _BLOCK_HEAD.size + int(header["block_bytes"])
        with self._lock:
            have = self._spaces.setdefault(space, _Space()).blocks
            whole = all(k in have and have[k].size == block_size for k in blocks)
            if whole:
                self._add(entry)
        if not whole:  # a block is missing or is not this snapshot's kind of block
            _unlink(path)
            self.stats.corrupt_removed += 1

    def _drop_siblings(self, model_slug: str, keep: str) -> None:
        self.scanned.result()
        if not self.owned:
            return
        for name in [n for n in list(self._spaces) if n != keep]:
            match = _SPACE_NAME.match(name)
            if match is not None and match["slug"] == model_slug:
                with self._lock:
                    self._drop_space(name)
                self.stats.incompatible_removed += _remove_tree(self.root / name)
        for path in self.root.glob(f"{model_slug}-*"):  # spaces not indexed (empty ones)
            if path.name != keep and path.name not in self._spaces:
                self.stats.incompatible_removed += _remove_tree(path)

    def _read(self, entry: DiskEntry) -> Loaded | None:
        with self._lock:
            space = self._spaces.get(entry.space)
            if space is None or space.entries.get(entry.tokens) is not entry:
                return None  # cleared or replaced since the lookup
        try:
            data = entry.path.read_bytes()
        except OSError:
            data = b""
        header = _parse(data)
        if header is None or tuple(header["tokens"]) != entry.tokens:
            return self._corrupt(entry)
        blocks = []
        for key in entry.blocks:
            block = _read_block(entry.path.parent / f"{key}{BLOCK_SUFFIX}", key)
            if block is None:
                return self._corrupt_block(entry.space, key)
            blocks.append(block)
        start = _HEAD.size + struct.unpack_from("<Q", data, 8)[0]
        try:
            payload = disk_blocks.assemble(
                header["layers"], memoryview(data)[start:], blocks, int(header["block_tokens"])
            )
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("prefix cache on disk: %s cannot be assembled: %s", entry.path, exc)
            return self._corrupt(entry)
        now = time.time()
        with self._lock:
            entry.used = now
            self.stats.reads += 1
        try:
            os.utime(entry.path, (now, now))
        except OSError:
            pass  # the order in RAM is kept; only a restart would not see this use
        return Loaded(entry, header["layers"], memoryview(payload))

    def _corrupt(self, entry: DiskEntry) -> None:
        with self._lock:
            self.stats.corrupt_removed += 1
            self._forget(entry)
        _unlink(entry.path)
        self._sweep()

    def _corrupt_block(self, space_name: str, key: str) -> None:
        """A bad or missing block: every snapshot naming it goes (each would be wrong)."""
        with self._lock:
            space = self._spaces.get(space_name)
            users = [e for e in space.entries.values() if key in e.blocks] if space else []
            for entry in users:
                self._forget(entry)
                self._doomed.append(entry.path)
            self.stats.corrupt_removed += len(users) + 1
        self._sweep()

    def _discard(self, entry: DiskEntry) -> None:
        with self._lock:
            self._forget(entry)
            self.stats.corrupt_removed += 1
        _unlink(entry.path)
        self._sweep()

    def _write(self, space: str, tokens: tuple[int, ...], trimmable: bool, enc: Encoded) -> None:
        try:
            if self.stats.writable:
                self._write_file(space, tokens, trimmable, enc)
        except OSError as exc:
            self._writes_off(exc)
        except ValueError as exc:  # a tree the codec made wrong: this snapshot stays in RAM
            log.warning("prefix cache on disk: a snapshot is not stored: %s", exc)
        finally:
            with self._lock:
                self._pending -= enc.nbytes
                self.stats.pending_writes -= 1

    def _header(self, space: str, tokens: tuple[int, ...], trimmable: bool, parts) -> bytes:
        """A snapshot file's header: what it holds, its blocks and its payload's checksum."""
        crc = 0
        for buf in parts.own:
            crc = zlib.crc32(buf, crc)
        header = {
            "format": FORMAT_VERSION,
            "space": space,
            "tokens": list(tokens),
            "trimmable": trimmable,
            "layers": parts.layers,
            "blocks": parts.keys,
            "block_tokens": self.block_tokens,
            "block_bytes": parts.block_bytes,
            "payload_bytes": parts.own_bytes,
            "payload_crc": crc,
        }
        return json.dumps(header, separators=(",", ":")).encode()

    def _write_file(self, space: str, tokens: tuple[int, ...], trimmable: bool, enc: Encoded):
        parts = disk_blocks.split(enc.layers, enc.buffers, tokens, self.block_tokens, space)
        head = self._header(space, tokens, trimmable, parts)
        size = _HEAD.size + len(head) + parts.own_bytes
        with self._lock:
            s = self._spaces.get(space)
            if s is not None and s.covers(tokens, trimmable):
                return
            have = s.blocks if s is not None else {}
            new = [i for i, key in enumerate(parts.keys) if key not in have]
            incoming = size + len(new) * (_BLOCK_HEAD.size + parts.block_bytes)
            self._pinned = set(parts.keys)  # room is made without deleting them
            self._fit(incoming)
            if self.stats.bytes + incoming > self.max_bytes:
                self.stats.spills_dropped += 1
                self._unpin(s)
                return
            s = self._spaces.setdefault(space, _Space())
        try:
            self._sweep()
            directory = self.root / space
            directory.mkdir(parents=True, exist_ok=True)
            for i in new:
                self._write_block(s, directory, parts.keys[i], parts.block(i))
            name = hashlib.sha256(repr(tokens).encode()).hexdigest()[:32]
            self._write_atomic(
                directory / f"{name}{SUFFIX}",
                [_HEAD.pack(MAGIC, len(head), zlib.crc32(head)), head, *parts.own],
            )
            entry = DiskEntry(
                directory / f"{name}{SUFFIX}",
                space,
                tokens,
                trimmable,
                size,
                time.time(),
                tuple(parts.keys),
            )
            with self._lock:
                self._add(entry)
                self.stats.writes += 1
                self.stats.bytes_written += size
                if trimmable:
                    self._drop_prefixes_of(entry)
        finally:
            with self._lock:
                self._unpin(s)
            self._sweep()

    def _write_block(self, space: _Space, directory: Path, key: str, pieces: list[Any]) -> None:
        crc, length = 0, 0
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
            length += piece.nbytes
        path = directory / f"{key}{BLOCK_SUFFIX}"
        self._write_atomic(
            path, [_BLOCK_HEAD.pack(BLOCK_MAGIC, key.encode(), length, crc), *pieces]
        )
        size = _BLOCK_HEAD.size + length
        with self._lock:
            space.blocks[key] = _Block(path, size)
            self.stats.bytes += size
            self.stats.blocks += 1
            self.stats.block_writes += 1
            self.stats.bytes_written += size

    def _write_atomic(self, final: Path, parts: list[Any]) -> None:
        """A temporary file, fsynced, renamed over ``final``, its directory fsynced."""
        temp = final.with_suffix(_TEMP)
        try:
            with open(temp, "wb") as f:
                for part in parts:
                    f.write(part)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(temp, final)
            if self.fsync:
                _fsync_dir(final.parent)
        except BaseException:
            _unlink(temp)
            raise

    def _clear(self, space: str | None) -> None:
        self.scanned.result()
        if not self.owned:
            return
        names = [space] if space is not None else list(self._spaces)
        for name in names:
            with self._lock:
                self._drop_space(name)
            _remove_tree(self.root / name)
        self.stats.writable = True
        self._probe_writable()

    # ---- the index (under the lock) ---------------------------------------------------

    def _add(self, entry: DiskEntry) -> None:
        space = self._spaces.setdefault(entry.space, _Space())
        old = space.entries.get(entry.tokens)
        if old is not None:  # the same file, rewritten: its blocks are unnamed after
            self._account(old, -1)
            space.remove(old.tokens)
        space.add(entry)
        self._account(entry, 1)
        for key in entry.blocks:
            space.blocks[key].refs += 1
        if old is not None:
            self._unref(space, old.blocks)

    def _account(self, entry: DiskEntry, sign: int) -> None:
        self.stats.bytes += sign * entry.size
        self.stats.entries += sign

    def _forget(self, entry: DiskEntry) -> None:
        space = self._spaces.get(entry.space)
        if space is not None and space.entries.get(entry.tokens) is entry:
            space.remove(entry.tokens)
            self._account(entry, -1)
            self._unref(space, entry.blocks)

    def _unref(self, space: _Space, keys: Iterable[str]) -> None:
        for key in keys:
            block = space.blocks.get(key)
            if block is not None:
                block.refs -= 1
                if block.refs <= 0 and key not in self._pinned:
                    self._drop_block(space, key)

    def _unpin(self, space: _Space | None) -> None:
        """The write is over: blocks it pinned that no snapshot names go."""
        pinned, self._pinned = self._pinned, set()
        for key in pinned if space is not None else ():
            block = space.blocks.get(key)
            if block is not None and block.refs <= 0:
                self._drop_block(space, key)

    def _drop_block(self, space: _Space, key: str) -> None:
        block = space.blocks.pop(key)
        self.stats.bytes -= block.size
        self.stats.blocks -= 1
        self._doomed.append(block.path)

    def _drop_space(self, name: str) -> None:
        """Forget a space whose directory is being deleted whole."""
        space = self._spaces.pop(name, None)
        if space is None:
            return
        for e in space.entries.values():
            self._account(e, -1)
        for block in space.blocks.values():
            self.stats.bytes -= block.size
            self.stats.blocks -= 1

    def _drop_prefixes_of(self, entry: DiskEntry) -> None:
        """A trimmable file serves all its prefixes: shorter trimmable files only cost bytes."""
        space = self._spaces[entry.space]
        for key in list(space.candidates(entry.tokens)):
            other = space.entries[key]
            if other is not entry and other.trimmable and entry.tokens[: len(key)] == key:
                self._forget(other)
                self._doomed.append(other.path)

    def _fit(self, incoming: int) -> None:
        """Delete least recently used snapshots (and the blocks only they name) until
        ``incoming`` more bytes fit the budget."""
        if self.stats.bytes + incoming <= self.max_bytes:
            return
        everything = [e for s in self._spaces.values() for e in s.entries.values()]
        for victim in sorted(everything, key=lambda e: e.used):
            if self.stats.bytes + incoming <= self.max_bytes:
                return
            self._forget(victim)
            self._doomed.append(victim.path)
            self.stats.evictions += 1

    def _sweep(self) -> None:
        """Delete the files dropped from the index (I/O thread, outside the lock)."""
        with self._lock:
            doomed, self._doomed = self._doomed, []
        for path in doomed:
            _unlink(path)

    def _writes_off(self, exc: OSError) -> None:
        if self.stats.writable:
            log.warning("prefix cache on disk: writes off, RAM only from now on (%s)", exc)
        self.stats.writable = False


@dataclass
class DiskView:
    """One loaded model's space in the store (what its prefix cache holds)."""

    store: DiskStore
    space: str
    spilled: int = field(default=0)

    def best(self, prompt: Sequence[int], limit: int) -> tuple[DiskEntry, int] | None:
        return self.store.best(self.space, prompt, limit)

    def read(self, entry: DiskEntry) -> Future[Loaded | None]:
        return self.store.read(entry)

    def spill(
        self, tokens: tuple[int, ...], trimmable: bool, enc: Encoded, *, behind: bool = False
    ) -> bool:
        return self.store.spill(self.space, tokens, trimmable, enc, behind=behind)

    def clear(self, every_space: bool = False) -> Future[None]:
        return self.store.clear(None if every_space else self.space)

    @property
    def ready(self) -> bool:
        """The index has been rebuilt from the files (lookups before it would miss)."""
        return self.store.scanned.done()

    def when_ready(self, timeout: float) -> None:
        try:
            self.store.scanned.result(timeout)
        except TimeoutError:
            pass


def _read_header(path: Path) -> tuple[dict[str, Any] | None, int]:
    """A file's header if its prefix, header checksum and size are right (payload unread)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_HEAD.size)
            if len(head) < _HEAD.size:
                return None, size
            magic, length, crc = _HEAD.unpack(head)
            if magic != MAGIC or length > size:
                return None, size
            raw = f.read(length)
    except OSError:
        return None, 0
    header = _decode_header(raw, crc)
    if header is None or size != _HEAD.size + length + header.get("payload_bytes", -1):
        return None, size
    return header, size


def _decode_header(raw: bytes, crc: int) -> dict[str, Any] | None:
    if zlib.crc32(raw) != crc:
        return None
    try:
        header = json.loads(raw)
    except ValueError:
        return None
    needed = ("format", "space", "tokens", "trimmable", "layers", "blocks", "block_tokens")
    needed += ("block_bytes", "payload_bytes", "payload_crc")
    return header if isinstance(header, dict) and all(k in header for k in needed) else None


def _parse(data: bytes) -> dict[str, Any] | None:
    """A whole file's header if every checksum and the length are right."""
    if len(data) < _HEAD.size:
        return None
    magic, length, crc = _HEAD.unpack_from(data)
    if magic != MAGIC or _HEAD.size + length > len(data):
        return None
    header = _decode_header(data[_HEAD.size : _HEAD.size + length], crc)
    if header is None or len(data) != _HEAD.size + length + header["payload_bytes"]:
        return None
    payload = memoryview(data)[_HEAD.size + length :]
    return header if zlib.crc32(payload) == header["payload_crc"] else None


def _block_size(path: Path) -> int | None:
    """A block file's size if its prefix, name and length are right (payload unread)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_BLOCK_HEAD.size)
    except OSError:
        return None
    if len(head) < _BLOCK_HEAD.size:
        return None
    magic, key, length, _ = _BLOCK_HEAD.unpack(head)
    ok = magic == BLOCK_MAGIC and key == path.stem.encode() and _BLOCK_NAME.match(path.stem)
    return size if ok and size == _BLOCK_HEAD.size + length else None


def _read_block(path: Path, key: str) -> memoryview | None:
    """A block's payload if the file is whole and its checksum right."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) < _BLOCK_HEAD.size:
        return None
    magic, name, length, crc = _BLOCK_HEAD.unpack_from(data)
    payload = memoryview(data)[_BLOCK_HEAD.size :]
    if magic != BLOCK_MAGIC or name != key.encode() or len(payload) != length:
        return None
    return payload if zlib.crc32(payload) == crc else None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("prefix cache on disk: cannot delete %s: %s", path, exc)


def _remove_tree(path: Path) -> int:
    """Delete a file or a directory; how many files went."""
    if path.is_dir() and not path.is_symlink():
        count = sum(1 for p in path.rglob("*") if p.is_file())
        shutil.rmtree(path, ignore_errors=True)
        return count
    _unlink(path)
    return 1


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
