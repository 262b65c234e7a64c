"""Embedding core: how the generation actor batches an embedding model's inputs.

A loaded embedding model gets an ``EmbeddingCore`` where a text model gets an
``EngineCore``; the model pool drives both alike (``submit``, ``abort``, ``step``,
``idle``, ``stats``). Each ``step()`` takes the oldest pending inputs, in arrival
order (requests first come, first served; a request's inputs in order), into one
forward pass: at most ``max_batch_inputs`` of them and ``max_batch_tokens`` padded
tokens (inputs x the longest; a longer input runs alone). A request spans as many
steps as its inputs need, shares each with others, and ends with one ``Embedded``
holding all its vectors. ``Started`` goes out when its first input runs, so its
queue timeout covers the wait.

Failures stay per request: a request past ``max_queued_inputs`` is refused (429);
a forward pass that raises fails its one request, or, when it held several, sends
each of them to run alone next, so only the request that fails alone fails (an
allocation failure fails the pass's requests with a 503 at once: no row is to blame).
No trio, no mlx: the runner (``runner/embedding.py``) does the MLX work and hands
back numpy arrays.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from mlxd.actors.engine.scheduler.memory import is_memory_error
from mlxd.actors.engine.scheduler.options import EmbeddingOptions
from mlxd.protocol.messages import (
    Embedded,
    EmbedRequest,
    EngineStats,
    EngineStep,
    Failed,
    RunnerCounters,
    Started,
)

log = logging.getLogger("mlxd.engine")


class EmbeddingRunner(Protocol):
    """What the embedding core needs from its runner (tests script a fake one)."""

    def embed(self, batch: list[tuple[int, ...]]) -> np.ndarray:
        """One forward pass over ``batch`` (right-padded, masked): float32 vectors,
        one row per input, in order."""
        ...

    def clear_cache(self) -> None: ...
    def release_buffers(self) -> None: ...
    def memory_stats(self) -> tuple[int, int]: ...
    def counters(self) -> RunnerCounters: ...


@dataclass
class _Pending:
    """A request's inputs, the next one to run, and the vectors made so far."""

    request: EmbedRequest
    next: int = 0
    started: bool = False
    vectors: dict[int, np.ndarray] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(i) for i in self.request.inputs)


class EmbeddingCore:
    """Pending embedding requests → padded batches of their inputs → their vectors."""

    def __init__(self, runner: EmbeddingRunner, options: EmbeddingOptions, retry_after_s=1.0):
        self.runner, self.options = runner, options
        self.retry_after_s = retry_after_s
        self.pending: OrderedDict[str, _Pending] = OrderedDict()  # arrival order
        self.solo: set[str] = set()  # requests to run alone (a shared pass of theirs failed)
        self._refused: list[Failed] = []  # submits refused, reported at the next step
        self._steps = self._last_batch = 0
        self._failed_steps = 0

    # ---- the pool's interface --------------------------------------------------------

    @property
    def idle(self) -> bool:
        return not self.pending and not self._refused

    def submit(self, request: Any) -> None:
        if not isinstance(request, EmbedRequest):  # the HTTP layer routes by model kind
            self._refused.append(_invalid(request.request_id, "this model only embeds"))
            return
        queued = self.queued_inputs
        limit = self.options.max_queued_inputs
        if queued and queued + len(request.inputs) > limit:
            self._refused.append(self._queue_full(request.request_id, queued))
            return
        self.pending[request.request_id] = _Pending(request)

    def abort(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.solo.discard(request_id)

    def step(self) -> EngineStep:
        failed, self._refused = self._refused, []
        started: list[Started] = []
        embedded: list[Embedded] = []
        batch = self._plan()
        if batch:
            started = [self._started(p) for p in {id(p): p for p, _ in batch}.values()]
            started = [s for s in started if s is not None]
            self._run(batch, embedded, failed)
        self._steps += 1
        return EngineStep(started=tuple(started), failed=tuple(failed), embedded=tuple(embedded))

    def stats(self) -> EngineStats:
        active, peak = self.runner.memory_stats()
        running = sum(1 for p in self.pending.values() if p.next > 0)
        return EngineStats(
            steps=self._steps,  # no decode steps: the decode averages stay the text models'
            waiting=len(self.pending) - running,
            prefilling=running,
            batch_size=self._last_batch,
            memory_active=active,
            memory_peak=peak,
            failed_steps=self._failed_steps,
            counters=self.runner.counters(),
        )

    @property
    def queued_inputs(self) -> int:
        return sum(len(p.request.inputs) - p.next for p in self.pending.values())

    # ---- batching --------------------------------------------------------------------

    def _plan(self) -> list[tuple[_Pending, int]]:
        """The next pass: (request, input index) oldest first, within both caps; a
        request marked solo runs alone, and only when it comes first."""
        o, batch, longest = self.options, [], 0
        for rid, pending in self.pending.items():
            if rid in self.solo and batch:
                break
            for i in range(pending.next, len(pending.request.inputs)):
                n = len(pending.request.inputs[i])
                wider = max(longest, n)
                full = len(batch) >= o.max_batch_inputs
                if batch and (full or (len(batch) + 1) * wider > o.max_batch_tokens):
                    return batch
                batch.append((pending, i))
                longest = wider
            if rid in self.solo:
                break
        return batch

    def _run(self, batch, embedded: list[Embedded], failed: list[Failed]) -> None:
        try:
            vectors = self.runner.embed([p.request.inputs[i] for p, i in batch])
        except Exception as exc:  # noqa: BLE001 - a failed pass fails its requests, not the daemon
            self._failed(batch, exc, failed)
            return
        self._last_batch = len(batch)
        for (pending, i), vector in zip(batch, vectors, strict=True):
            pending.vectors[i] = vector
            pending.next = i + 1
        for pending in {id(p): p for p, _ in batch}.values():
            if pending.next == len(pending.request.inputs):
                embedded.append(self._done(pending))

    def _failed(self, batch, exc: Exception, failed: list[Failed]) -> None:
        self._failed_steps += 1
        owners = list({p.request.request_id: p for p, _ in batch})
        log.error(
            "embedding pass of %d inputs (%d requests) failed: %r", len(batch), len(owners), exc
        )
        if len(owners) > 1 and not is_memory_error(exc):
            self.solo.update(owners)  # each runs alone next: only the culprit fails
            return
        for rid in owners:
            self.abort(rid)
            failed.append(self._failure(rid, exc))

    def _done(self, pending: _Pending) -> Embedded:
        rid = pending.request.request_id
        self.abort(rid)
        n = len(pending.request.inputs)
        vectors = np.stack([pending.vectors[i] for i in range(n)]).astype(np.float32)
        return Embedded(request_id=rid, vectors=vectors, prompt_tokens=pending.tokens)

    def _started(self, pending: _Pending) -> Started | None:
        if pending.started:
            return None
        pending.started = True
        return Started(request_id=pending.request.request_id, prompt_tokens=pending.tokens)

    # ---- failures --------------------------------------------------------------------

    def _queue_full(self, request_id: str, queued: int) -> Failed:
        return Failed(
            request_id=request_id,
            reason="queue_full",
            message=f"{queued} inputs already wait to be embedded by this model "
            f"(embeddings.max_queued_inputs = {self.options.max_queued_inputs}); retry later",
            retry_after=self.retry_after_s,
        )

    def _failure(self, request_id: str, exc: Exception) -> Failed:
        if is_memory_error(exc):
            return Failed(
                request_id=request_id,
                reason="out_of_memory",
                message=f"embedding failed: out of memory ({exc}); retry later",
                retry_after=self.retry_after_s,
            )
        return Failed(
            request_id=request_id, reason="internal_error", message=f"embedding failed: {exc}"
        )


def _invalid(request_id: str, message: str) -> Failed:
    return Failed(request_id=request_id, reason="invalid_request", message=message)
