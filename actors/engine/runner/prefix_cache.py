"""Prefix cache: prompt-cache snapshots keyed by token blocks, LRU under a byte budget.

A sync core with no mlx: the runner hands in opaque cache snapshots with their
size and whether they can be trimmed, and gets back the best snapshot for a new
prompt plus how many of its tokens it covers.

- Index: the chained hash of each full ``block_size``-token block of an entry's
  tokens points at the entries that contain that prefix. A lookup walks the new
  prompt's block hashes to the deepest shared block, then compares tokens
  exactly past it.
- Trimmable snapshots (every layer is attention-like) serve any shorter common
  prefix: the runner trims the copy. Snapshots with SSM / ArraysCache state are
  valid only at exactly their own length, so they serve a prompt only when the
  whole entry is a prefix of it; anything else is a miss, never approximated.
- The runner always copies what it gets, so a snapshot is never shared mutably
  by running requests, and nothing stays pinned once requests finish.
- Eviction (over budget on insert, or ``evict`` for running requests' memory) takes
  the least recently used snapshot, with one exception for cache keys (the client's
  ``prompt_cache_key``): the newest snapshot of each of the ``affinity_keys`` most
  recently used keys is *protected*, and goes only when nothing unprotected is left.
  A key's newest snapshot is the last one inserted, or hit by a lookup, for a request
  carrying that key. So a keyed conversation keeps its latest state through a burst
  of other traffic that plain LRU would let push it out; a key that more than
  ``affinity_keys`` other keys have been used after loses its protection.
- Disk tier (``disk_tier``): an evicted snapshot goes to ``on_evict`` (the runner
  writes it to disk) instead of being lost, and so does every snapshot on ``spill_all``
  (shutdown, model unload). A snapshot read back from disk is inserted with
  ``from_disk``; its first hit counts as a disk hit. Every other snapshot inserted also
  goes to ``on_insert`` (the disk tier writes it behind, so a crash keeps it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from mlxd.protocol.messages import PrefixCacheCounters


@dataclass
class Entry:
    tokens: tuple[int, ...]
    snapshot: Any
    nbytes: int
    trimmable: bool
    from_disk: bool = False  # read back from the disk tier, not hit since


@dataclass(frozen=True)
class Hit:
    """Reuse ``entry.snapshot`` for the first ``length`` tokens (trim it if shorter)."""

    entry: Entry
    length: int


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of each full block: ``h[i]`` identifies ``tokens[:(i+1)*block_size]``."""
    out, h = [], 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        h = hash((h, tuple(tokens[start : start + block_size])))
        out.append(h)
    return out


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int) -> int:
    n = min(len(a), len(b))
    i = start
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class PrefixCache:
    """Block-keyed snapshots with LRU eviction under ``max_bytes``."""

    block_size: int
    max_bytes: int
    affinity_keys: int = 16  # cache keys whose newest snapshot is protected (0: plain LRU)
    _entries: OrderedDict[tuple[int, ...], Entry] = field(default_factory=OrderedDict)
    _by_block: dict[int, set[tuple[int, ...]]] = field(default_factory=dict)
    _short: set[tuple[int, ...]] = field(default_factory=set)  # shorter than one block
    # cache key -> its newest snapshot, least recently used key first
    _newest: OrderedDict[str, tuple[int, ...]] = field(default_factory=OrderedDict)
    stats: PrefixCacheCounters = field(default_factory=PrefixCacheCounters)
    on_evict: Callable[[Entry], None] | None = None  # the disk tier's spill (None: off)
    # a snapshot was just made (not one read back from disk): the disk tier's write-behind
    on_insert: Callable[[Entry], None] | None = None
    disk: Any = None  # the disk tier's view (``disk_tier.DiskView``), for its counters
    disk_spaces: Any = None  # which disk space a snapshot goes to (``disk_codec.Spaces``)

    def __post_init__(self) -> None:
        self.stats.max_bytes = self.max_bytes

    def __contains__(self, tokens: Sequence[int]) -> bool:
        return tuple(tokens) in self._entries

    def lookup(self, prompt: Sequence[int], limit: int, key: str = "") -> Hit | None:
        """The snapshot covering the most of ``prompt[:limit]``; counts a hit or a miss.
        A hit becomes ``key``'s newest snapshot."""
        best = self._best(prompt, limit)
        if best is None or best.length == 0:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(best.entry.tokens)
        self.claim(best.entry.tokens, key)
        self.stats.hits += 1
        self.stats.cached_tokens += best.length
        if best.entry.from_disk:
            best.entry.from_disk = False
            self.stats.disk_hits += 1
            self.stats.disk_cached_tokens += best.length
        return best

    def peek(self, prompt: Sequence[int], limit: int) -> int:
        """How much of ``prompt[:limit]`` a lookup would reuse; counts nothing, moves nothing."""
        best = self._best(prompt, limit)
        return best.length if best is not None else 0

    def _candidates(self, prompt: Sequence[int]) -> set[tuple[int, ...]]:
        found = set(self._short)
        for h in block_hashes(prompt, self.block_size):
            keys = self._by_block.get(h)
            if not keys:
                break
            found |= keys
        return found

    def _best(self, prompt: Sequence[int], limit: int) -> Hit | None:
        best: Hit | None = None
        for key in self._candidates(prompt):
            entry = self._entries[key]
            shared = min(_common_prefix(key, prompt, 0), limit)
            usable = shared if entry.trimmable else (len(key) if shared == len(key) else 0)
            if usable and (best is None or usable > best.length):
                best = Hit(entry, usable)
        return best

    def claim(self, tokens: Sequence[int], key: str) -> None:
        """Make the snapshot of ``tokens`` ``key``'s newest (nothing for "" or no snapshot)."""
        entry = tuple(tokens)
        if not key or not self.affinity_keys or entry not in self._entries:
            return
        self._newest[key] = entry
        self._newest.move_to_end(key)
        while len(self._newest) > self.affinity_keys:
            self._newest.popitem(last=False)

    def _owners(self, entry: tuple[int, ...]) -> list[str]:
        return [k for k, newest in self._newest.items() if newest == entry]

    def _victim(self, spare: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The least recently used snapshot that no key holds as its newest, else the least
        recently used of all; never ``spare`` (the one being inserted) while others are left."""
        protected = {*self._newest.values(), spare}
        candidates = [k for k in self._entries if k != spare] or [spare]
        return next((k for k in candidates if k not in protected), candidates[0])

    def insert(
        self,
        tokens: Sequence[int],
        snapshot: Any,
        nbytes: int,
        trimmable: bool,
        *,
        from_disk: bool = False,
    ) -> None:
        """Add a snapshot of the cache after ``tokens``; evict entries over budget (least
        recently used first, keys' newest last; to disk when the tier is on)."""
        key = tuple(tokens)
        if not key or nbytes > self.max_bytes:
            return
        owners = self._owners(key)
        if key in self._entries:
            self._drop(key)
        self._entries[key] = Entry(key, snapshot, nbytes, trimmable, from_disk)
        self._newest.update(dict.fromkeys(owners, key))  # a replaced snapshot keeps its keys
        hashes = block_hashes(key, self.block_size)
        for h in hashes:
            self._by_block.setdefault(h, set()).add(key)
        if not hashes:
            self._short.add(key)
        self.stats.bytes += nbytes
        if trimmable:
            self._drop_trimmable_prefixes_of(key)
        while self.stats.bytes > self.max_bytes:
            self._evict_one(self._victim(spare=key))
        self.stats.entries = len(self._entries)
        if self.on_insert is not None and not from_disk and key in self._entries:
            self.on_insert(self._entries[key])

    def _drop_trimmable_prefixes_of(self, key: tuple[int, ...]) -> None:
        """A trimmable entry serves all its prefixes: shorter trimmable copies only cost bytes."""
        for other in list(self._candidates(key)):
            entry = self._entries[other]
            if other != key and entry.trimmable and key[: len(other)] == other:
                self._newest.update(dict.fromkeys(self._owners(other), key))  # it serves them
                self._drop(other)

    def _drop(self, key: tuple[int, ...]) -> None:
        entry = self._entries.pop(key)
        for h in block_hashes(key, self.block_size):
            keys = self._by_block.get(h)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_block[h]
        self._short.discard(key)
        for owner in self._owners(key):
            del self._newest[owner]
        self.stats.bytes -= entry.nbytes
        self.stats.entries = len(self._entries)

    def evict(self, nbytes: int) -> int:
        """Drop snapshots until ``nbytes`` are freed (or none is left), in the order
        ``insert`` evicts them; returns the bytes freed."""
        freed = 0
        while freed < nbytes and self._entries:
            key = self._victim()
            freed += self._entries[key].nbytes
            self._evict_one(key)
        return freed

    def _evict_one(self, key: tuple[int, ...]) -> None:
        entry = self._entries[key]
        self._drop(key)
        self.stats.evictions += 1
        if self.on_evict is not None:
            self.on_evict(entry)

    def spill_all(self) -> int:
        """Hand every snapshot to ``on_evict``, most recently used first, and drop them
        (shutdown, model unload); how many went."""
        entries = list(reversed(self._entries.values()))
        if self.on_evict is not None:
            for entry in entries:
                self.on_evict(entry)
        self.clear()
        return len(entries)

    def counters(self) -> PrefixCacheCounters:
        """A copy of the counters to publish, with the disk tier's (shared) ones."""
        disk = self.disk.store.counters() if self.disk is not None else None
        return msgspec.structs.replace(self.stats, disk=disk)

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)
