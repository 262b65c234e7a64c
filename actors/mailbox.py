"""Per-request mailboxes: where every stage delivers a request's output.

A producer never blocks on a mailbox: text deltas merge while the client reads
slowly, so one slow reader cannot stall the detokenizer (and through it the
engine). The HTTP handler opens the mailbox, awaits ``get()`` and closes it
when done; events for an unregistered mailbox are dropped (the client is gone).

A mailbox holds at most one generation's output: pending deltas are merged
every ``_MERGE_AT`` puts, and nothing is added after the final event. A client
that leaves more than ``max_unread`` bytes untaken (``streaming.max_unread_bytes``,
counted as the text plus ~64 bytes per logprob entry) has its pending output
dropped and its request failed (408 ``client_not_reading``). The
registry reports each mailbox whose final event arrived (``ended()``), so the
request's admission slot is freed when its generation ends, not when a client
that may never read gets round to reading it.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import trio
from mlxd.protocol.messages import Failed, Finished, MailboxEvent, Started, TextDelta, ToolCallDelta

# Pending deltas are merged into one this often: a client that reads nothing costs
# its output's text, not a growing list of small objects.
_MERGE_AT = 64
_LOGPROB_BYTES = 64  # about what one logprob entry costs in the response JSON


def _size(delta: TextDelta) -> int:
    """About how many bytes of response a delta becomes."""
    calls = sum(len(c.arguments) + len(c.name or "") for c in delta.tool_calls)
    entries = sum(1 + len(p.top) for p in delta.logprobs)
    return len(delta.text) + len(delta.reasoning) + calls + _LOGPROB_BYTES * entries


class Bell:
    """Wakes the reader of one or more mailboxes (the ``n`` choices of a request share one)."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def ring(self) -> None:
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()

    def reset(self) -> None:
        if self._event.is_set():
            self._event = trio.Event()


def merge_calls(calls: list[ToolCallDelta]) -> tuple[ToolCallDelta, ...]:
    """Argument pieces joined onto the delta before them when it is the same call's."""
    out: list[ToolCallDelta] = []
    for c in calls:
        if out and c.id is None and out[-1].index == c.index:
            out[-1] = msgspec.structs.replace(out[-1], arguments=out[-1].arguments + c.arguments)
        else:
            out.append(c)
    return tuple(out)


def merge_deltas(deltas: list[TextDelta]) -> TextDelta:
    """One delta holding several in order (reasoning, content, calls and logprobs each joined)."""
    if len(deltas) == 1:
        return deltas[0]
    return TextDelta(
        text="".join(d.text for d in deltas),
        reasoning="".join(d.reasoning for d in deltas),
        tool_calls=merge_calls([c for d in deltas for c in d.tool_calls]),
        logprobs=tuple(p for d in deltas for p in d.logprobs),
        tokens=sum(d.tokens for d in deltas),
    )


class Mailbox:
    """Merged pending output of one request, in order: Started, text, final event."""

    def __init__(
        self,
        request_id: str,
        bell: Bell | None = None,
        on_final: Callable[[Mailbox], None] | None = None,
        max_unread: int = 0,
        on_moved: Callable[[str, bool], None] | None = None,
    ):
        self.request_id = request_id
        # Set once the engine's sequence is over: it ended it itself, or the streamer
        # aborted it (a stop string): nobody else need send an ``Abort``.
        self.engine_done = False
        self.began = False  # a ``Started`` arrived: the request left the queues
        self._started: Started | None = None
        self._deltas: list[TextDelta] = []
        self._final: Finished | Failed | None = None
        self._closed = False
        self._bell = bell or Bell()
        self._on_final = on_final
        # the queue moved: this request started (False), or ended after it had (True)
        self._on_moved = on_moved
        self._max_unread = max_unread  # 0: no cap
        self._unread = 0

    @property
    def ended(self) -> bool:
        """The final event has arrived (it may not have been taken yet)."""
        return self._closed

    def put(self, event: MailboxEvent) -> None:
        if self._closed:
            return
        match event:
            case Started():
                self._started = event
                if not self.began and self._on_moved is not None:
                    self._on_moved(self.request_id, False)
                self.began = True
            case TextDelta():
                self._deltas.append(event)
                self._unread += _size(event)
                if self._max_unread and self._unread > self._max_unread:
                    self._deltas, self._unread = [], 0
                    self.put(self._not_reading())
                    return
                if len(self._deltas) >= _MERGE_AT:
                    self._deltas = [merge_deltas(self._deltas)]
            case Finished() | Failed():
                self._final = event
                self._closed = True
                if self._on_final is not None:
                    self._on_final(self)
                if self.began and self._on_moved is not None:
                    self._on_moved(self.request_id, True)
        self._bell.ring()

    def _not_reading(self) -> Failed:
        return Failed(
            request_id=self.request_id,
            reason="client_not_reading",
            message=f"the client left over {self._max_unread} bytes of output unread "
            "(streaming.max_unread_bytes); generation was stopped",
        )

    def take(self) -> list[MailboxEvent]:
        """Everything pending, merged, without waiting (maybe nothing)."""
        self._unread = 0
        events: list[MailboxEvent] = []
        if self._started is not None:
            events.append(self._started)
            self._started = None
        if self._deltas:
            events.append(merge_deltas(self._deltas))
            self._deltas = []
        if self._final is not None:
            events.append(self._final)
            self._final = None
        return events

    async def get(self) -> list[MailboxEvent]:
        """Wait for output; return everything pending, merged."""
        while True:
            self._bell.reset()
            events = self.take()
            if events:
                return events
            await self._bell.wait()


class Mailboxes:
    """The registry of open mailboxes, shared by the stages that deliver to them."""

    def __init__(self, max_unread_bytes: int = 0) -> None:
        self._max_unread = max_unread_bytes
        self._open: dict[str, Mailbox] = {}
        self._emptied = trio.Event()
        self._ended: list[Mailbox] = []
        self._ended_bell = Bell()
        # told (request id, ended) when a request starts or a started one ends: what
        # restarts the ``admission.queue_timeout_s`` clocks (``daemon/pipeline.py``)
        self.on_moved: Callable[[str, bool], None] | None = None

    def __len__(self) -> int:
        return len(self._open)

    def get(self, request_id: str) -> Mailbox | None:
        return self._open.get(request_id)

    def deliver(self, event: Failed | MailboxEvent, request_id: str | None = None) -> None:
        """Put an event in its request's mailbox; drop it if the client has gone."""
        rid = request_id or getattr(event, "request_id", None)
        box = self._open.get(rid) if rid else None
        if box is not None:
            box.put(event)

    def register(self, request_id: str, bell: Bell | None = None) -> Mailbox:
        if request_id in self._open:
            raise KeyError(f"duplicate request id {request_id}")
        box = Mailbox(request_id, bell, self._ended_one, self._max_unread, self._moved)
        self._open[request_id] = box
        return box

    def _moved(self, request_id: str, ended: bool) -> None:
        if self.on_moved is not None:
            self.on_moved(request_id, ended)

    def _ended_one(self, box: Mailbox) -> None:
        self._ended.append(box)
        self._ended_bell.ring()

    async def ended(self) -> list[Mailbox]:
        """Wait for mailboxes whose final event arrived since the last call; return them."""
        while True:
            self._ended_bell.reset()
            if self._ended:
                ended, self._ended = self._ended, []
                return ended
            await self._ended_bell.wait()

    def fail_all(self, failure: Callable[[str], Failed]) -> int:
        """End every unfinished request with ``failure(request_id)``; return how many."""
        unfinished = [box for box in self._open.values() if not box.ended]
        for box in unfinished:
            box.put(failure(box.request_id))
        return len(unfinished)

    def unregister(self, request_id: str) -> None:
        self._open.pop(request_id, None)
        if not self._open:
            self._emptied.set()

    async def wait_empty(self) -> None:
        """Return once no request is in flight (used by the graceful drain)."""
        while self._open:
            self._emptied = trio.Event()
            await self._emptied.wait()
