"""How an HTTP/1.1 connection ends: after each response it is closed or reused, never left hung.

hypercorn 0.18 closes the connection (``Connection: close``, HTTP/1.0, a request body
not yet received) or readies it for the next request (keep-alive) from inside the ASGI
``send`` of the response's last body message. In that same call it tells the app the
request is over (``http.disconnect``), and quart-trio then cancels the task making the
call: the cancellation lands mid-way, so the socket is left open (a health checker
waiting for the close hangs, an HTTP/1.0 client never sees a stream's end) or a
keep-alive connection never reads its next request (hypercorn issue #330).

``FinishResponses`` (ASGI middleware, the outermost) shields that last send from the
cancellation, bounded by ``server.send_timeout_s``. Before it, a response that was
ready before its request's body had all arrived (a 405 or 404 that never reads the
body) waits for the rest of the body, up to ``server.body_timeout_s`` from the
request's start, so that the connection can be reused rather than closed; a body
declared larger than ``server.max_body_bytes`` is not waited for. A stalled body
that a route reads is answered 408 by quart at the same deadline. hypercorn itself is
not touched.
"""

from __future__ import annotations

import math
from typing import Any

import trio

Message = dict[str, Any]


class FinishResponses:
    """ASGI middleware: a response's last ``send`` waits (bounded) for the request's
    body, and the close or reuse of the connection inside it is not cut short."""

    def __init__(self, app, *, finish_s: float, body_s: float, max_body_bytes: int):
        self.app = app
        self.finish_s = finish_s if finish_s > 0 else math.inf
        self.body_s, self.max_body_bytes = body_s, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        deadline = trio.current_time() + self.body_s
        received = trio.Event()  # the whole body, or the client is gone

        async def receiving() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                received.set()
            return message

        async def finishing_send(message: Message) -> None:
            if not _last(message):
                await send(message)
                return
            if _declared_size(scope) <= self.max_body_bytes:
                with trio.move_on_at(deadline):
                    await received.wait()
            with trio.move_on_after(self.finish_s) as bounded:
                bounded.shield = True
                await send(message)

        await self.app(scope, receiving, finishing_send)


def _last(message: Message) -> bool:
    return message["type"] == "http.response.body" and not message.get("more_body", False)


def _declared_size(scope) -> int:
    """The request's Content-Length (0 when absent: chunked or no body; a malformed one
    never reaches the app)."""
    for name, value in scope["headers"]:
        if name.lower() == b"content-length" and value.strip().isdigit():
            return int(value)
    return 0
