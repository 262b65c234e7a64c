"""Detokenizer / streamer actor: engine token steps in, text events out to mailboxes.

``StreamState`` is the sync core: per request an incremental detokenizer, a
stop matcher and an output parser (reasoning blocks, tool calls: see
``actors/parsers.py``), all set up from the request's ``OutputSpec`` in its
``Started`` and fed one ``EngineStep`` at a time; token logprobs become text
pieces. It never waits on a client: mailboxes merge and never block. An
exception in one request's share of a step fails that request (a logged 500),
not the actor. Each step returns the requests it ended while the engine still
runs them (a stop string matched, or their output failed): the actor loop sends
their ``Abort`` to the engine at once, so a finished sequence stops decoding
whether or not its client reads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio
from mlxd.actors.detokenizer import (
    Decoder,
    IncrementalDetokenizer,
    StopMatcher,
    TokenTexts,
    marker_ids,
    special_ids,
)
from mlxd.actors.families import reasoning
from mlxd.actors.families.formats import BY_NAME
from mlxd.actors.families.output import OutputParser
from mlxd.actors.mailbox import Mailbox, Mailboxes
from mlxd.actors.parsers import Parsed
from mlxd.protocol.messages import (
    Abort,
    EngineInbox,
    EngineStep,
    Failed,
    Finished,
    FinishReason,
    LogprobPiece,
    MailboxEvent,
    OutputSpec,
    Started,
    TextDelta,
    TokenLogprob,
    TokenStep,
    ToolCallDelta,
)

log = logging.getLogger("mlxd")


@dataclass
class _Request:
    detokenizer: IncrementalDetokenizer
    matcher: StopMatcher
    parser: OutputParser
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefilled_tokens: int = -1
    end_ids: frozenset[int] = frozenset()  # OutputSpec.end_ids


class StreamState:
    """Turns engine steps into mailbox events for every request in them."""

    def __init__(self, tokenizer: Decoder, mailboxes: Mailboxes):
        self._tokenizer = tokenizer
        self._mailboxes = mailboxes
        self._requests: dict[str, _Request] = {}
        self._texts = TokenTexts(tokenizer)
        self._special = special_ids(tokenizer)
        self._aborts: list[str] = []  # this step's, for ``on_step`` to return

    def __len__(self) -> int:
        return len(self._requests)

    def on_step(self, step: EngineStep) -> list[str]:
        """Deliver one step's events; return the requests whose sequences to abort."""
        self._aborts = []
        for started in step.started:
            if self._guarded(started.request_id, self._start, started):
                self._mailboxes.deliver(started)
        for tokens in step.tokens:
            self._guarded(tokens.request_id, self._on_tokens, tokens)
        for failed in step.failed:
            self._requests.pop(failed.request_id, None)
            self._mailboxes.deliver(failed)
        self._forget_ended()
        return self._aborts

    def _forget_ended(self) -> None:
        """Drop the state of requests that ended elsewhere (client gone, timed out, drained):
        their abort is on its way to the engine, which may send no final step for them."""
        for rid in [r for r in self._requests if _over(self._mailboxes.get(r))]:
            del self._requests[rid]

    def _guarded(self, request_id: str, work: Callable[[Any], None], arg: Any) -> bool:
        """One request's share of a step; an exception fails that request alone (a 500,
        logged) and aborts its sequence in the engine."""
        try:
            work(arg)
        except Exception as exc:  # a bug in one request's output, never the actor's
            log.error("request %s: streaming its output failed", request_id, exc_info=exc)
            self._requests.pop(request_id, None)
            self._abort(request_id)
            self._mailboxes.deliver(
                Failed(
                    request_id=request_id,
                    reason="internal_error",
                    message=f"internal error while streaming the output "
                    f"({type(exc).__name__}: {exc}); the server log has the traceback",
                )
            )
            return False
        return True

    def _start(self, started: Started) -> None:
        if self._mailboxes.get(started.request_id) is None:
            return  # client already gone; the handler has sent the abort
        detokenizer = IncrementalDetokenizer(self._tokenizer, self._hidden(started.output))
        self._requests[started.request_id] = _Request(
            detokenizer,
            StopMatcher(started.output.stop),
            OutputParser(started.output),
            started.prompt_tokens,
            started.cached_tokens,
            prefilled_tokens=started.prefilled_tokens,
            end_ids=frozenset(started.output.end_ids),
        )

    def _hidden(self, spec: OutputSpec) -> frozenset[int] | None:
        """Special tokens to hide; None (the tokenizer's own rule) unless a parser needs some."""
        fmt = BY_NAME.get(spec.tool_format or "")
        tags = reasoning.of_pair(spec.reasoning) if spec.reasoning else None
        answer = (tags.open, tags.close, *tags.drop) if tags else ()
        markers = (fmt.show if fmt else ()) + answer
        shown = marker_ids(self._tokenizer, markers) if markers else frozenset()
        return self._special - shown if shown else None

    def _deliver(self, request_id: str, event: MailboxEvent) -> None:
        self._mailboxes.deliver(event, request_id)

    def _on_tokens(self, step: TokenStep) -> None:
        rid = step.request_id
        req = self._requests.get(rid)
        if req is None:
            return  # finished by a stop string, or the client is gone
        req.completion_tokens += len(step.tokens)
        tokens, at_end = _before_end(step.tokens, req.end_ids)
        if at_end:  # an end token of the request's own (OutputSpec.end_ids): a stop
            req.completion_tokens -= len(step.tokens) - len(tokens) - 1
            step = TokenStep(
                request_id=rid,
                tokens=tokens,
                finish_reason="stop",
                logprobs=step.logprobs[: len(tokens)],
            )
        ending = step.finish_reason is not None
        text = req.detokenizer.add(tokens)
        if ending:
            text += req.detokenizer.flush()
        shown = req.matcher.feed(text)
        if req.matcher.stopped or ending:
            shown += req.matcher.flush()
        parsed = req.parser.feed(shown) if shown else Parsed()
        if req.matcher.stopped or ending:
            cut = step.finish_reason == "length" and not req.matcher.stopped
            parsed.extend(req.parser.flush(cut=cut))
        self._deliver_parsed(rid, req, parsed, step)
        if req.matcher.stopped or at_end:
            self._abort(rid)  # the engine would go on decoding it
            self._finish(rid, "stop")
        elif step.finish_reason is not None:
            self._finish(rid, step.finish_reason)

    def _deliver_parsed(self, rid: str, req: _Request, parsed: Parsed, step: TokenStep) -> None:
        calls = tuple(
            ToolCallDelta(index=p.index, id=p.id, name=p.name, arguments=p.arguments)
            for p in parsed.calls
        )
        logprobs = tuple(self._piece(lp) for lp in step.logprobs)
        if parsed.content or parsed.reasoning or calls or logprobs:
            delta = TextDelta(
                text=parsed.content,
                reasoning=parsed.reasoning,
                tool_calls=calls,
                logprobs=logprobs,
                tokens=len(step.tokens),
            )
            self._deliver(rid, delta)

    def _piece(self, lp: TokenLogprob) -> LogprobPiece:
        text, raw = self._texts(lp.token)
        top = tuple((*self._texts(t), v) for t, v in lp.top)
        return LogprobPiece(token=text, bytes=raw, logprob=lp.logprob, top=top)

    def _abort(self, request_id: str) -> None:
        self._aborts.append(request_id)
        box = self._mailboxes.get(request_id)
        if box is not None:
            box.engine_done = True  # the session need not abort it again

    def _finish(self, request_id: str, reason: FinishReason) -> None:
        req = self._requests.pop(request_id)
        box = self._mailboxes.get(request_id)
        if box is not None:
            box.engine_done = True
        if reason == "stop" and req.parser.calls:
            reason = "tool_calls"
        finished = Finished(
            finish_reason=reason,
            prompt_tokens=req.prompt_tokens,
            completion_tokens=req.completion_tokens,
            cached_tokens=req.cached_tokens,
            prefilled_tokens=req.prefilled_tokens,
            stop_string=req.matcher.matched,
            cut_call=req.parser.cut_call,
        )
        self._deliver(request_id, finished)


def _before_end(tokens: tuple[int, ...], end_ids: frozenset[int]) -> tuple[tuple[int, ...], bool]:
    """The tokens before the first end token, and whether there was one."""
    for i, token in enumerate(tokens if end_ids else ()):
        if token in end_ids:
            return tokens[:i], True
    return tokens, False


def _over(box: Mailbox | None) -> bool:
    return box is None or box.ended


async def run(
    inbox: trio.MemoryReceiveChannel[EngineStep],
    engine: trio.MemorySendChannel[EngineInbox],
    state: StreamState,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Feed every engine step to the stream state until the engine closes its outbox;
    send the engine an ``Abort`` for each sequence the stream state ended."""
    task_status.started()
    async with inbox, engine, trio.open_nursery() as aborts:
        async for step in inbox:
            for request_id in state.on_step(step):
                # Never awaited here: the engine may be waiting for this loop to take a step.
                aborts.start_soon(_abort, engine, request_id)


async def _abort(engine: trio.MemorySendChannel[EngineInbox], request_id: str) -> None:
    try:
        await engine.send(Abort(request_id=request_id))
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the engine has stopped: nothing runs any more
