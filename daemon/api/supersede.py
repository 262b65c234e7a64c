"""Editor completion requests that supersede each other (``fim.supersede``).

An editor sends a fill-in-the-middle request every few keystrokes; the one before is
stale. Requests with the same key (client address, model, route, and a digest of the
whole text outside the line being typed: ``file_key``) are one editor typing in one
file. Once a newer one has **started** (it passed admission and the queues and holds
its batch row), every older one ends at once with what it had so far and
``finish_reason`` "abort"; a newer request that is refused (``queue_full``) or still
waits cancels nothing. An older request superseded while it still waits for its turn
ends without text, in its route's own format (its whole body, or its stream's last
frames), because its events are the ones a finished request has.

Used by ``/infill`` (llama.cpp's), ``/v1/completions`` with ``suffix`` and Ollama's
``/api/generate`` with ``suffix``. The ``Superseder`` is a plain class; the only trio in
it is the cancel scopes it is handed.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import AsyncIterator, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import trio
from mlxd.daemon.api.common import ChoiceEvent, start
from mlxd.daemon.pipeline import Pipeline
from mlxd.protocol.messages import AdmittedRequest, Finished, Started, TextDelta


def file_key(prefix: str, suffix: str) -> bytes:
    """A digest of the text outside the cursor's line: the prefix up to its last new line
    and the suffix from its first. Typing on the line changes neither; a change anywhere
    else (another file, even one that begins and ends alike) does."""
    head = prefix[: prefix.rfind("\n") + 1]
    newline = suffix.find("\n")
    tail = suffix[newline + 1 :] if newline >= 0 else ""
    digest = hashlib.blake2b(digest_size=16)
    for part in (head, tail):
        data = part.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


@dataclass(eq=False)
class Ticket:
    """One request's place among those of its key: cancelled once a newer one starts."""

    key: Hashable
    seq: int
    started: bool = False
    superseded: bool = False
    scopes: list[trio.CancelScope] = field(default_factory=list)

    def supersede(self) -> None:
        self.superseded = True
        for scope in self.scopes:
            scope.cancel()


@contextmanager
def watching(ticket: Ticket) -> Iterator[trio.CancelScope]:
    """A cancel scope that a newer request cancels (at once if one has already)."""
    with trio.CancelScope() as scope:
        if ticket.superseded:
            scope.cancel()
        ticket.scopes.append(scope)
        try:
            yield scope
        finally:
            ticket.scopes.remove(scope)


class Superseder:
    """The open FIM requests per key, in arrival order."""

    def __init__(self) -> None:
        self._open: dict[Hashable, list[Ticket]] = {}
        self._seq = itertools.count()

    def __len__(self) -> int:
        """Open requests."""
        return sum(len(tickets) for tickets in self._open.values())

    def enter(self, key: Hashable) -> Ticket:
        ticket = Ticket(key, next(self._seq))
        self._open.setdefault(key, []).append(ticket)
        return ticket

    def started(self, ticket: Ticket) -> None:
        """``ticket``'s request started: every older one of its key ends (and it ends at
        once itself if a newer one started first)."""
        ticket.started = True
        for other in self._open.get(ticket.key, ()):
            if other.seq < ticket.seq:
                other.supersede()
            elif other.started and other is not ticket:
                ticket.supersede()

    def leave(self, ticket: Ticket) -> None:
        tickets = self._open.get(ticket.key, [])
        if ticket in tickets:
            tickets.remove(ticket)
        if not tickets:
            self._open.pop(ticket.key, None)


@dataclass
class _Tally:
    """Each choice's counts so far, for the ``Finished`` of a superseded request."""

    n: int
    prompt: dict[int, tuple[int, int]] = field(default_factory=dict)  # (prompt, cached)
    completion: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def see(self, batch: list[ChoiceEvent]) -> None:
        for i, event in batch:
            if isinstance(event, Started):
                self.prompt[i] = (event.prompt_tokens, event.cached_tokens)
            elif isinstance(event, TextDelta):
                self.completion[i] = self.completion.get(i, 0) + event.tokens
            elif isinstance(event, Finished):
                self.finished.add(i)

    def aborted(self) -> list[ChoiceEvent]:
        """Each unfinished choice's end, ``abort`` with its counts so far."""
        out: list[ChoiceEvent] = []
        for i in range(self.n):
            if i not in self.finished:
                prompt, cached = self.prompt.get(i, (0, 0))
                completion = self.completion.get(i, 0)
                out.append((i, _aborted(prompt, completion, cached)))
        return out


def _aborted(prompt: int, completion: int, cached: int) -> Finished:
    return Finished(
        finish_reason="abort",
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
    )


async def start_newest(
    superseder: Superseder | None,
    key: Hashable,
    pipeline: Pipeline,
    requests: list[AdmittedRequest],
    model: str,
) -> tuple[list[ChoiceEvent], AsyncIterator[list[ChoiceEvent]]]:
    """``start`` (``daemon/api/common.py``) as one of ``key``'s requests: once it has
    started the older ones end; when a newer one starts it ends, with what it had, its
    events those of a finished request (none: ``start`` itself)."""
    if superseder is None:
        return await start(pipeline, requests, model)
    ticket = superseder.enter(key)
    tally = _Tally(len(requests))
    try:
        with watching(ticket) as scope:
            first, rest = await start(pipeline, requests, model)
        if scope.cancelled_caught:  # a newer one started while this one waited
            first, rest = tally.aborted(), _nothing()
        else:
            superseder.started(ticket)
    except BaseException:
        superseder.leave(ticket)
        raise
    events = _until_superseded(first, rest, ticket, superseder, tally)
    return await anext(events), events  # started: its cleanup runs however it ends


async def _until_superseded(
    first: list[ChoiceEvent],
    rest: AsyncIterator[list[ChoiceEvent]],
    ticket: Ticket,
    superseder: Superseder,
    tally: _Tally,
) -> AsyncIterator[list[ChoiceEvent]]:
    """``first`` and ``rest``, cut short by a newer request; the ticket given up when
    they end however they end (closing ``rest`` aborts the sequences)."""
    try:
        tally.see(first)
        yield first
        while True:
            with watching(ticket) as scope:
                batch = await anext(rest, None)
            if scope.cancelled_caught:
                yield tally.aborted()
                return
            if batch is None:
                return
            tally.see(batch)
            yield batch
    finally:
        superseder.leave(ticket)
        await rest.aclose()  # type: ignore[attr-defined]


async def _nothing() -> AsyncIterator[list[ChoiceEvent]]:
    return
    yield  # an async generator with no batches
