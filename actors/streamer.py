"""Detokenizer / streamer actor: engine token steps in, text events out to mailboxes.

``StreamState`` is the sync core: per-request incremental detokenizer and stop
matcher, fed one ``EngineStep`` at a time. The actor loop only adapts it to the
engine's outbox. It never waits on a client: mailboxes merge and never block.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from actors.detokenizer import Decoder, IncrementalDetokenizer, StopMatcher
from actors.mailbox import Mailboxes
from protocol.messages import (
    EngineStep,
    Finished,
    FinishReason,
    MailboxEvent,
    Started,
    TextDelta,
    TokenStep,
)


@dataclass
class _Request:
    detokenizer: IncrementalDetokenizer
    matcher: StopMatcher
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefilled_tokens: int = -1


class StreamState:
    """Turns engine steps into mailbox events for every request in them."""

    def __init__(self, tokenizer: Decoder, mailboxes: Mailboxes):
        self._tokenizer = tokenizer
        self._mailboxes = mailboxes
        self._requests: dict[str, _Request] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def on_step(self, step: EngineStep) -> None:
        for started in step.started:
            self._start(started)
            self._mailboxes.deliver(started)
        for tokens in step.tokens:
            self._on_tokens(tokens)
        for failed in step.failed:
            self._requests.pop(failed.request_id, None)
            self._mailboxes.deliver(failed)

    def _start(self, started: Started) -> None:
        box = self._mailboxes.get(started.request_id)
        if box is None:
            return  # client already gone; the handler has sent the abort
        self._requests[started.request_id] = _Request(
            IncrementalDetokenizer(self._tokenizer),
            StopMatcher(box.stop),
            started.prompt_tokens,
            started.cached_tokens,
            prefilled_tokens=started.prefilled_tokens,
        )

    def _deliver(self, request_id: str, event: MailboxEvent) -> None:
        self._mailboxes.deliver(event, request_id)

    def _on_tokens(self, step: TokenStep) -> None:
        rid = step.request_id
        req = self._requests.get(rid)
        if req is None:
            return  # finished by a stop string, or the client is gone
        req.completion_tokens += len(step.tokens)
        text = req.detokenizer.add(step.tokens)
        if step.finish_reason is not None:
            text += req.detokenizer.flush()
        shown = req.matcher.feed(text)
        if req.matcher.stopped or step.finish_reason is not None:
            shown += req.matcher.flush()
        if shown:
            self._deliver(rid, TextDelta(text=shown, tokens=len(step.tokens)))
        if req.matcher.stopped:
            self._finish(rid, "stop", engine_done=False)
        elif step.finish_reason is not None:
            self._finish(rid, step.finish_reason, engine_done=True)

    def _finish(self, request_id: str, reason: FinishReason, *, engine_done: bool) -> None:
        req = self._requests.pop(request_id)
        box = self._mailboxes.get(request_id)
        if box is not None:
            box.engine_done = engine_done
        finished = Finished(
            finish_reason=reason,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=req.completion_tokens,
            cached_tokens=req.cached_tokens,
            prefilled_tokens=req.prefilled_tokens,
        )
        self._deliver(request_id, finished)


async def run(
    inbox: trio.MemoryReceiveChannel[EngineStep],
    state: StreamState,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Feed every engine step to the stream state until the engine closes its outbox."""
    task_status.started()
    async with inbox:
        async for step in inbox:
            state.on_step(step)
