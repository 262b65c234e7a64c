"""The front door of the actor graph, as the HTTP handlers see it.

A ``Session`` is one request's life: its mailbox is registered and an ``Admit``
sent on entry; ``close()`` (shielded, idempotent) unregisters the mailbox, frees
the admission slot and, unless the engine already ended the sequence, aborts it.
A client disconnect cancels the handler, whose cleanup calls ``close()``: that is
the abort path.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio

from actors.engine.types import ModelInfo
from actors.mailbox import Bell, Mailbox, Mailboxes
from protocol.messages import (
    Abort,
    AdmissionInbox,
    Admit,
    AdmittedRequest,
    EngineInbox,
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

    def __init__(self, pipeline: Pipeline, mailbox: Mailbox):
        self._pipeline = pipeline
        self.mailbox = mailbox
        self._closed = False

    @property
    def request_id(self) -> str:
        return self.mailbox.request_id

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        p = self._pipeline
        p.mailboxes.unregister(self.request_id)
        with trio.CancelScope(shield=True):
            if not self.mailbox.engine_done:
                await p.engine.send(Abort(request_id=self.request_id))
            await p.admission.send(Release(request_id=self.request_id))

    async def events(self) -> AsyncIterator[list[MailboxEvent]]:
        """Batches of merged events until the final one; closes the session at the end."""
        try:
            while True:
                batch = await self.mailbox.get()
                yield batch
                if isinstance(batch[-1], Finished | Failed):
                    return
        finally:
            await self.close()


@dataclass
class Pipeline:
    """Channels into the actor graph plus the shared mailbox registry."""

    admission: trio.MemorySendChannel[AdmissionInbox]
    engine: trio.MemorySendChannel[EngineInbox]
    mailboxes: Mailboxes
    state: ServerState = ServerState.LOADING
    info: ModelInfo | None = None
    builder: Any = None  # the tokenizer actor's PromptBuilder, for count_tokens
    count_limiter: trio.CapacityLimiter | None = None  # its worker threads (tokenizer.workers)

    async def count_tokens(self, request: AdmittedRequest) -> int:
        """Prompt tokens of a request, rendered as it would be served (worker thread)."""
        tokens = await trio.to_thread.run_sync(
            self.builder.tokens, request, limiter=self.count_limiter
        )
        return len(tokens)

    async def submit(self, request: AdmittedRequest, bell: Bell | None = None) -> Session:
        """Register the request's mailbox (sharing ``bell`` with its siblings) and admit it."""
        stop = request.sampling.stop
        session = Session(self, self.mailboxes.register(request.request_id, stop, bell))
        try:
            await self.admission.send(Admit(request=request))
        except BaseException:
            await session.close()
            raise
        return session
