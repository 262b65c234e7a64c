"""The one Server-Sent Events driver: every API streams through it, giving only its shapes.

A ``Shape`` turns the request's events into one API's frames: ``opening`` before
anything, ``started`` / ``delta`` / ``finished`` per choice event, ``closing``
(with the request's ``Usage``) once every choice has finished, ``failed`` for an
error after the first frame (which ends the stream), ``keepalive`` whenever nothing
has come for ``streaming.keepalive_s`` (a long prompt prefilling: clients and proxies
that time out a quiet connection keep it), and ``terminator`` last in every case
(OpenAI's ``data: [DONE]``; empty for the others). The driver closes the request's
sessions however the stream ends, a client that leaves included.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from mlxd.daemon.api.common import ChoiceEvent, Usage
from mlxd.daemon.api.errors import ApiError
from mlxd.protocol.messages import Failed, Finished, Started, TextDelta
from quart import Response


class Shape(Protocol):
    """One API's stream frames (each method returns whole SSE frames, in order)."""

    terminator: bytes

    def opening(self) -> list[bytes]: ...

    def started(self, i: int, event: Started) -> list[bytes]: ...

    def delta(self, i: int, event: TextDelta) -> list[bytes]: ...

    def finished(self, i: int, event: Finished) -> list[bytes]: ...

    def closing(self, usage: Usage) -> list[bytes]: ...

    def failed(self, error: ApiError) -> list[bytes]: ...

    def keepalive(self) -> list[bytes]: ...


# An SSE comment: every SSE parser skips it, so it keeps a connection busy and means nothing.
KEEPALIVE_COMMENT = b": keep-alive\n\n"


def frame(data: bytes, event: str | None = None) -> bytes:
    """One SSE frame: ``data`` (JSON, already encoded) under an optional ``event`` name."""
    head = b"event: " + event.encode() + b"\n" if event else b""
    return head + b"data: " + data + b"\n\n"


def _frames(shape: Shape, i: int, event: Started | TextDelta | Finished) -> list[bytes]:
    match event:
        case Started():
            return shape.started(i, event)
        case TextDelta():
            return shape.delta(i, event)
        case Finished():
            return shape.finished(i, event)


async def _body(
    shape: Shape, first: list[ChoiceEvent], rest: AsyncIterator[list[ChoiceEvent]]
) -> AsyncIterator[bytes]:
    finished: list[Finished] = []
    try:
        for data in shape.opening():
            yield data
        batch: list[ChoiceEvent] | None = first
        while batch is not None:
            if not batch:  # nothing for streaming.keepalive_s
                for data in shape.keepalive():
                    yield data
            for i, event in batch:
                if isinstance(event, Failed):
                    for data in shape.failed(ApiError.from_failed(event)):
                        yield data
                    if shape.terminator:
                        yield shape.terminator
                    return
                if isinstance(event, Finished):
                    finished.append(event)
                for data in _frames(shape, i, event):
                    yield data
            batch = await anext(rest, None)
        for data in shape.closing(Usage.of(finished)):
            yield data
        if shape.terminator:
            yield shape.terminator
    finally:
        await rest.aclose()  # type: ignore[attr-defined]


def stream(shape: Shape, first: list[ChoiceEvent], rest: AsyncIterator[list[ChoiceEvent]]):
    """The ``text/event-stream`` response of a started request."""
    return Response(
        _body(shape, first, rest),
        content_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
