"""The front door of the actor graph, as the HTTP handlers see it.

A ``Session`` is one request's life: its mailbox is registered and an ``Admit``
sent on entry; ``close()`` (shielded, idempotent) unregisters the mailbox, frees
the admission slot and, unless the engine already ended the sequence, aborts it.
A client disconnect cancels the handler, whose cleanup calls ``close()``: that is
the abort path. The slot and the sequence are freed earlier, by
``Pipeline.release_ended``, as soon as the request's final event reaches its
mailbox, so a client that stops reading holds neither. The per-request
deadline (``admission.request_timeout_s``) is stamped on the request here and
kept twice: the engine fails a sequence past it (so generation stops even
while the client reads nothing), and the session stops waiting at it wherever
the request is (queued, tokenizing, waiting for memory). Either way the client gets a 504 ``request_timeout`` (or, once
streaming, an error event) and ``close()`` aborts whatever is left. Each session
keeps a ``RequestTrace`` that it hands to the telemetry when it closes.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio

from actors.admission import AdmissionPolicy
from actors.engine.types import ModelInfo
from actors.mailbox import Bell, Mailbox, Mailboxes
from actors.tokenizer import bad_input
from daemon.telemetry import RequestTrace, Telemetry
from protocol.messages import (
    Abort,
    AdmissionInbox,
    Admit,
    AdmittedRequest,
    EngineInbox,
    EngineStats,
    Failed,
    Finished,
    MailboxEvent,
    Release,
)


class ServerState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


class Session:
    """One admitted request: its mailbox, and the cleanup that must always run."""

    def __init__(self, pipeline: Pipeline, mailbox: Mailbox, timeout_s: float = 0.0):
        self._pipeline = pipeline
        self.mailbox = mailbox
        self._closed = self._released = False
        now = trio.current_time()
        self.timeout_s = timeout_s
        self.deadline = now + timeout_s if timeout_s > 0 else math.inf  # trio clock
        self.trace = RequestTrace(mailbox.request_id, now)

    @property
    def request_id(self) -> str:
        return self.mailbox.request_id

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        p = self._pipeline
        p.mailboxes.unregister(self.request_id)
        p.sessions.pop(self.request_id, None)
        self.trace.close(trio.current_time())
        p.telemetry.request_done(self.trace)
        await self.release()

    async def release(self, *, shield: bool = True) -> None:
        """Abort the sequence unless the engine ended it, and free the admission slot (once)."""
        if self._released:
            return
        self._released = True
        p = self._pipeline
        with trio.CancelScope(shield=shield):
            if not self.mailbox.engine_done:
                await p.engine.send(Abort(request_id=self.request_id))
            await p.admission.send(Release(request_id=self.request_id))

    async def events(self) -> AsyncIterator[list[MailboxEvent]]:
        """Batches of merged events until the final one; closes the session at the end."""
        try:
            while True:
                batch = await self._next_batch()
                self.trace.observe(batch, trio.current_time())
                yield batch
                if isinstance(batch[-1], Finished | Failed):
                    return
        finally:
            await self.close()

    def take(self) -> list[MailboxEvent]:
        """Pending events without waiting (or the deadline's failure), seen by the trace."""
        events = self.mailbox.take()
        if not events and trio.current_time() >= self.deadline:
            events = [self._deadline_passed()]
        if events:
            self.trace.observe(events, trio.current_time())
        return events

    async def _next_batch(self) -> list[MailboxEvent]:
        # Checked first: get() returns without a checkpoint while output keeps coming.
        if trio.current_time() < self.deadline:
            with trio.move_on_at(self.deadline):
                return await self.mailbox.get()
        return [self._deadline_passed()]

    def _deadline_passed(self) -> Failed:
        return Failed(
            request_id=self.request_id,
            reason="request_timeout",
            message=(
                f"the request did not finish within {self.timeout_s:g}s "
                f"(admission.request_timeout_s); generation was stopped after "
                f"{self.trace.completion_tokens} tokens"
            ),
        )


@dataclass
class Pipeline:
    """Channels into the actor graph, the shared mailbox registry, and read-only views
    of the actors' state for /metrics and /v1/status."""

    admission: trio.MemorySendChannel[AdmissionInbox]
    engine: trio.MemorySendChannel[EngineInbox]
    mailboxes: Mailboxes
    request_timeout_s: float = 0.0
    state: ServerState = ServerState.LOADING
    info: ModelInfo | None = None
    policy: AdmissionPolicy | None = None  # read only outside the admission actor
    engine_stats: EngineStats = field(default_factory=EngineStats)
    sessions: dict[str, Session] = field(default_factory=dict)
    telemetry: Telemetry = field(default_factory=Telemetry)

    builder: Any = None  # the tokenizer actor's PromptBuilder, for count_tokens
    count_limiter: trio.CapacityLimiter | None = None  # its worker threads (tokenizer.workers)

    async def count_tokens(self, request: AdmittedRequest) -> int:
        """Prompt tokens of a request, rendered as it would be served (worker thread).

        Raises ``PromptError`` (a 400) for a prompt that bad input cannot build, as the
        tokenizer actor fails such a request; any other exception is a bug (a 500).
        """
        try:
            tokens = await trio.to_thread.run_sync(
                self.builder.tokens, request, limiter=self.count_limiter
            )
        except Exception as exc:
            error = bad_input(exc)
            if error is None:
                raise
            raise error from exc
        return len(tokens)

    async def release_ended(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Free the slot of each request whose final event reached its mailbox.

        The slot follows the generation, not the client: a client that reads
        nothing (its handler blocked writing to the socket) or has vanished keeps
        its connection, but its slot comes back when the engine ends the sequence
        (at the latest at the request's deadline). A stop-string or streamer
        failure also aborts the engine's sequence here, at once.
        """
        task_status.started()
        while True:
            for box in await self.mailboxes.ended():
                session = self.sessions.get(box.request_id)
                if session is not None:  # unshielded: cancelled with the actors it sends to
                    await session.release(shield=False)

    def __post_init__(self) -> None:
        self.telemetry.watch(self)

    def publish(self, stats: EngineStats) -> None:
        """The engine's snapshot after each step (called on the trio thread)."""
        self.engine_stats = stats

    async def submit(self, request: AdmittedRequest, bell: Bell | None = None) -> Session:
        """Register the request's mailbox (sharing ``bell`` with its siblings) and admit it."""
        if self.request_timeout_s > 0:  # the engine's copy of the deadline, on its clock
            deadline = time.monotonic() + self.request_timeout_s
            request = msgspec.structs.replace(request, deadline=deadline)
        stop = request.sampling.stop
        mailbox = self.mailboxes.register(request.request_id, stop, bell)
        session = self.sessions[request.request_id] = Session(self, mailbox, self.request_timeout_s)
        try:
            await self.admission.send(Admit(request=request))
        except BaseException:
            await session.close()
            raise
        return session
