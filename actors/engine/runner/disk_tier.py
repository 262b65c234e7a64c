"""Prefix cache, disk tier: snapshots spilled from RAM, kept in files under a byte budget.

A sync core with no mlx: ``disk_codec`` turns a snapshot into a JSON-able layer tree
plus raw buffers on the engine thread (and back); this module owns the files, their
index and one I/O thread, so no file is read or written on the engine thread.

- Layout: ``<root>/<slug>-<space hash>/<token hash>.kv``. A *space* is everything that
  changes a snapshot's bytes (model files, adapter, chat template, KV quantization,
  cache layout, ``FORMAT_VERSION``), hashed; ``slug`` is the served model's id. At
  start-up every space of a model that is not configured, and every file that is not a
  well-formed file of this format, is deleted; when a model loads, the other spaces of
  its slug (its earlier files, templates, ``kv_bits``) are deleted.
- File: ``MAGIC``, header length, header CRC-32, the JSON header (space, tokens,
  trimmable, layer tree, payload length and CRC-32), the payload. Written to a
  temporary file, fsynced, renamed, directory fsynced: a reader sees a whole file or
  none. A file whose size, header or payload checksum is wrong is deleted and counted
  (``corrupt_removed``) and is a miss, never served.
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

from mlxd.actors.engine.runner.prefix_cache import _common_prefix, block_hashes
from mlxd.protocol.messages import DiskCounters

log = logging.getLogger("mlxd.disk_cache")

FORMAT_VERSION = 1
MAGIC = b"MLXDKV\x00\x01"
_HEAD = struct.Struct("<8sQI")  # magic, header length, header crc32
SUFFIX = ".kv"
_TEMP = ".tmp"
_SPACE_NAME = re.compile(r"^(?P<slug>[A-Za-z0-9_.-]{1,64})-(?P<hash>[0-9a-f]{20})$")
_BLOCK = 64  # the disk index's own block size (any size gives the same matches)
LOCK = "LOCK"  # the owner's lock file in the root (its pid inside)


def slug(model_id: str) -> str:
    """A model id as a directory name (``""``: the default model)."""
    cleaned = re.sub(r"[^A-Za-z0-9_.-]+", "_", model_id or "default").strip("._")
    return (cleaned or "default")[:64]


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
    point into (objects with the buffer protocol; they keep their arrays alive)."""

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


@dataclass(frozen=True)
class Loaded:
    """A file read back and verified: its header (``layers``) and its payload."""

    entry: DiskEntry
    layers: list[Any]
    payload: memoryview


class _Space:
    """One space's entries with a block index, as the RAM tier matches them."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], DiskEntry] = {}
        self.by_block: dict[int, set[tuple[int, ...]]] = {}
        self.short: set[tuple[int, ...]] = set()

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
    start-up). ``max_pending_bytes``: spilled snapshots waiting for the I/O thread;
    past it a spill is dropped (counted), so the queue never holds more memory.
    """

    def __init__(
        self,
        root: Path,
        max_bytes: int,
        models: Iterable[str],
        *,
        max_pending_bytes: int = 1 << 30,
        fsync: bool = True,
    ):
        self.root = Path(root).expanduser()
        self.max_bytes = max_bytes
        self.models = set(models)
        self.max_pending_bytes = max_pending_bytes
        self.fsync = fsync
        self.stats = DiskCounters(enabled=True, writable=True, max_bytes=max_bytes)
        self._lock = threading.Lock()
        self._spaces: dict[str, _Space] = {}
        self._pending = 0  # bytes spilled, not yet written
        self._doomed: list[Path] = []  # files dropped from the index, to delete unlocked
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxd-disk")
        self._lock_fd: int | None = None
        self.owner_pid = 0  # another process holding the directory (0: none, or us)
        self.scanned: Future[None] = self._io.submit(self._scan)

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

    def spill(self, space: str, tokens: tuple[int, ...], trimmable: bool, enc: Encoded) -> bool:
        """Queue a snapshot for writing; False (counted) if writes are off or the queue is full."""
        with self._lock:
            s = self._spaces.get(space)
            if s is not None and s.covers(tokens, trimmable):
                return True
            if not self.stats.writable or self._pending + enc.nbytes > self.max_pending_bytes:
                self.stats.spills_dropped += 1
                return False
            self._pending += enc.nbytes
            self.stats.pending_writes += 1
        self._io.submit(self._write, space, tokens, trimmable, enc)
        return True

    def discard(self, entry: DiskEntry) -> None:
        """A file whose contents could not be made into a snapshot: delete it (counted)."""
        self._io.submit(self._discard, entry)

    def clear(self, space: str | None = None) -> Future[None]:
        """Delete every file of ``space`` (of every space when None); writes come back on."""
        return self._io.submit(self._clear, space)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until everything queued so far has been written."""
        self._io.submit(lambda: None).result(timeout)

    def close(self) -> None:
        self._io.shutdown(wait=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    @property
    def owned(self) -> bool:
        """False: another process holds the directory; this store does nothing (known
        once ``scanned`` is done)."""
        return self.owner_pid == 0

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

    def counters(self) -> DiskCounters:
        with self._lock:
            return DiskCounters(**{f: getattr(self.stats, f) for f in self.stats.__struct_fields__})

    # ---- the I/O thread ---------------------------------------------------------------

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
            for path in list(child.iterdir()):
                self._index_file(child.name, path)
        with self._lock:
            self._fit(0)
        self._sweep()
        self._probe_writable()
        log.info(
            "prefix cache on disk: %d snapshots, %.0f MiB of %.0f MiB in %s",
            self.stats.entries,
            self.stats.bytes / 2**20,
            self.max_bytes / 2**20,
            self.root,
        )

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
        tokens = tuple(header["tokens"])
        entry = DiskEntry(
            path, space, tokens, bool(header["trimmable"]), size, path.stat().st_mtime
        )
        with self._lock:
            self._add(entry)

    def _drop_siblings(self, model_slug: str, keep: str) -> None:
        self.scanned.result()
        if not self.owned:
            return
        for name in [n for n in list(self._spaces) if n != keep]:
            match = _SPACE_NAME.match(name)
            if match is not None and match["slug"] == model_slug:
                with self._lock:
                    space = self._spaces.pop(name)
                    for e in space.entries.values():
                        self._account(e, -1)
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
        with self._lock:
            bad = header is None or tuple(header["tokens"]) != entry.tokens
            if bad:
                self.stats.corrupt_removed += 1
                self._forget(entry)
            now = time.time()
            entry.used = now
        if bad:
            _unlink(entry.path)
            return None
        try:
            os.utime(entry.path, (now, now))
        except OSError:
            pass  # the order in RAM is kept; only a restart would not see this use
        self.stats.reads += 1
        start = _HEAD.size + struct.unpack_from("<Q", data, 8)[0]
        return Loaded(entry, header["layers"], memoryview(data)[start:])

    def _discard(self, entry: DiskEntry) -> None:
        with self._lock:
            self._forget(entry)
            self.stats.corrupt_removed += 1
        _unlink(entry.path)

    def _write(self, space: str, tokens: tuple[int, ...], trimmable: bool, enc: Encoded) -> None:
        try:
            if self.stats.writable:
                self._write_file(space, tokens, trimmable, enc)
        except OSError as exc:
            self._writes_off(exc)
        finally:
            with self._lock:
                self._pending -= enc.nbytes
                self.stats.pending_writes -= 1

    def _write_file(self, space: str, tokens: tuple[int, ...], trimmable: bool, enc: Encoded):
        crc = 0
        for buf in enc.buffers:
            crc = zlib.crc32(buf, crc)
        header = {
            "format": FORMAT_VERSION,
            "space": space,
            "tokens": list(tokens),
            "trimmable": trimmable,
            "layers": enc.layers,
            "payload_bytes": enc.nbytes,
            "payload_crc": crc,
        }
        head = json.dumps(header, separators=(",", ":")).encode()
        size = _HEAD.size + len(head) + enc.nbytes
        with self._lock:
            s = self._spaces.get(space)
            if s is not None and s.covers(tokens, trimmable):
                return
            if size > self.max_bytes:
                self.stats.spills_dropped += 1
                return
            self._fit(size)
        self._sweep()
        directory = self.root / space
        directory.mkdir(parents=True, exist_ok=True)
        name = hashlib.sha256(repr(tokens).encode()).hexdigest()[:32]
        final, temp = directory / f"{name}{SUFFIX}", directory / f"{name}{_TEMP}"
        try:
            with open(temp, "wb") as f:
                f.write(_HEAD.pack(MAGIC, len(head), zlib.crc32(head)))
                f.write(head)
                for buf in enc.buffers:
                    f.write(buf)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            os.replace(temp, final)
            if self.fsync:
                _fsync_dir(directory)
        except BaseException:
            _unlink(temp)
            raise
        entry = DiskEntry(final, space, tokens, trimmable, size, time.time())
        with self._lock:
            self._add(entry)
            self.stats.writes += 1
            if trimmable:
                self._drop_prefixes_of(entry)
        self._sweep()

    def _clear(self, space: str | None) -> None:
        self.scanned.result()
        if not self.owned:
            return
        names = [space] if space is not None else list(self._spaces)
        for name in names:
            with self._lock:
                s = self._spaces.pop(name, None)
                for e in s.entries.values() if s is not None else ():
                    self._account(e, -1)
            _remove_tree(self.root / name)
        self.stats.writable = True
        self._probe_writable()

    # ---- the index (under the lock) ---------------------------------------------------

    def _add(self, entry: DiskEntry) -> None:
        space = self._spaces.setdefault(entry.space, _Space())
        old = space.entries.get(entry.tokens)
        if old is not None:
            self._account(old, -1)
            space.remove(old.tokens)
        space.add(entry)
        self._account(entry, 1)

    def _account(self, entry: DiskEntry, sign: int) -> None:
        self.stats.bytes += sign * entry.size
        self.stats.entries += sign

    def _forget(self, entry: DiskEntry) -> None:
        space = self._spaces.get(entry.space)
        if space is not None and space.entries.get(entry.tokens) is entry:
            space.remove(entry.tokens)
            self._account(entry, -1)

    def _drop_prefixes_of(self, entry: DiskEntry) -> None:
        """A trimmable file serves all its prefixes: shorter trimmable files only cost bytes."""
        space = self._spaces[entry.space]
        for key in list(space.candidates(entry.tokens)):
            other = space.entries[key]
            if other is not entry and other.trimmable and entry.tokens[: len(key)] == key:
                self._forget(other)
                self._doomed.append(other.path)

    def _fit(self, incoming: int) -> None:
        """Delete least recently used files until ``incoming`` more bytes fit the budget."""
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

    def spill(self, tokens: tuple[int, ...], trimmable: bool, enc: Encoded) -> bool:
        return self.store.spill(self.space, tokens, trimmable, enc)

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
    needed = ("format", "space", "tokens", "trimmable", "layers", "payload_bytes", "payload_crc")
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
