"""The Responses API's store: finished ``store: true`` responses, bounded, in memory.

A stored response keeps its JSON body (for ``GET /v1/responses/{id}``) and its
history: the input items it ran on (its own ``previous_response_id`` chain
included) followed by its output items, which a request naming it as
``previous_response_id`` puts before its own input. Entries expire
``ttl_s`` after they are stored; past ``max_entries`` or ``max_bytes`` the oldest
go first. Plain Python: the HTTP handlers call it from trio's one thread and no
method awaits, so each call is atomic.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec


@dataclass(frozen=True)
class Stored:
    body: bytes  # the response object as JSON
    history: list[dict[str, Any]]  # input items, then output items, as JSON objects
    expires: float
    size: int


class ResponseStore:
    """Response id → ``Stored``; ``ttl_s`` 0: entries do not expire (the caps still hold)."""

    def __init__(
        self,
        max_entries: int,
        max_bytes: int,
        ttl_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_entries, self.max_bytes, self.ttl_s = max_entries, max_bytes, ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def put(self, rid: str, body: bytes, history: list[dict[str, Any]]) -> bool:
        """Keep a response; False when it alone is larger than ``max_bytes``."""
        size = len(body) + len(msgspec.json.encode(history))
        if size > self.max_bytes:
            return False
        self.delete(rid)
        expires = self.clock() + self.ttl_s if self.ttl_s else float("inf")
        self.entries[rid] = Stored(body, history, expires, size)
        self.bytes += size
        self._evict()
        return True

    def get(self, rid: str) -> Stored | None:
        self._expire()
        return self.entries.get(rid)

    def delete(self, rid: str) -> bool:
        stored = self.entries.pop(rid, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        return True

    def __len__(self) -> int:
        return len(self.entries)

    def _expire(self) -> None:
        # Every entry has the same TTL, so insertion order is expiry order.
        now = self.clock()
        while self.entries and next(iter(self.entries.values())).expires <= now:
            self.delete(next(iter(self.entries)))

    def _evict(self) -> None:
        self._expire()
        while len(self.entries) > self.max_entries or self.bytes > self.max_bytes:
            self.delete(next(iter(self.entries)))
