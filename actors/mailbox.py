"""Per-request mailboxes: where every stage delivers a request's output.

A producer never blocks on a mailbox: text deltas merge while the client reads
slowly, so one slow reader cannot stall the detokenizer (and through it the
engine). The HTTP handler opens the mailbox, awaits ``get()`` and closes it
when done; events for an unregistered mailbox are dropped (the client is gone).
"""

from __future__ import annotations

import trio

from protocol.messages import Failed, Finished, MailboxEvent, Started, TextDelta


class Mailbox:
    """Merged pending output of one request, in order: Started, text, final event."""

    def __init__(self, request_id: str, stop: tuple[str, ...] = ()):
        self.request_id = request_id
        self.stop = stop
        self.engine_done = False  # set once the engine has ended the sequence itself
        self._started: Started | None = None
        self._texts: list[str] = []
        self._tokens = 0
        self._final: Finished | Failed | None = None
        self._closed = False
        self._wakeup = trio.Event()

    def put(self, event: MailboxEvent) -> None:
        if self._closed:
            return
        match event:
            case Started():
                self._started = event
            case TextDelta(text=text, tokens=tokens):
                self._texts.append(text)
                self._tokens += tokens
            case Finished() | Failed():
                self._final = event
                self._closed = True
        self._wakeup.set()

    def _take(self) -> list[MailboxEvent]:
        events: list[MailboxEvent] = []
        if self._started is not None:
            events.append(self._started)
            self._started = None
        if self._texts or self._tokens:
            events.append(TextDelta(text="".join(self._texts), tokens=self._tokens))
            self._texts, self._tokens = [], 0
        if self._final is not None:
            events.append(self._final)
            self._final = None
        return events

    async def get(self) -> list[MailboxEvent]:
        """Wait for output; return everything pending, merged."""
        while True:
            events = self._take()
            if events:
                return events
            self._wakeup = trio.Event()
            await self._wakeup.wait()


class Mailboxes:
    """The registry of open mailboxes, shared by the stages that deliver to them."""

    def __init__(self) -> None:
        self._open: dict[str, Mailbox] = {}
        self._emptied = trio.Event()

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

    def register(self, request_id: str, stop: tuple[str, ...] = ()) -> Mailbox:
        if request_id in self._open:
            raise KeyError(f"duplicate request id {request_id}")
        box = self._open[request_id] = Mailbox(request_id, stop)
        return box

    def unregister(self, request_id: str) -> None:
        self._open.pop(request_id, None)
        if not self._open:
            self._emptied.set()

    async def wait_empty(self) -> None:
        """Return once no request is in flight (used by the graceful drain)."""
        while self._open:
            self._emptied = trio.Event()
            await self._emptied.wait()
