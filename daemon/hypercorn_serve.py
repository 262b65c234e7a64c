"""hypercorn's trio server, with every accepted connection guarded: the one place mlxd
reaches past ``hypercorn.trio.serve``.

hypercorn closes an idle HTTP/1.1 connection after ``keep_alive_timeout``
(``server.idle_timeout_s``), but an HTTP/2 connection with no stream open never
starts that timer: a client that sends the HTTP/2 preface and nothing else holds
its socket (and a descriptor) for ever. mlxd opens no HTTP/2 stream (its settings
allow 0, ``daemon/supervisor.py``), so such a connection can do nothing but wait:
``ConnectionGuard`` ends it ``idle_timeout_s`` after its preface, as if the client
had closed it. ``server.max_connections`` counts every open connection, HTTP/2 ones
included; one past it is answered 503 and closed at once.

hypercorn has no hook for either, so ``serve`` is ``hypercorn.trio.run.worker_serve``
(plain TCP only, which is all mlxd binds) with the connection handler wrapped. It
leans on hypercorn's ``TCPServer``, ``Lifespan`` and ``WorkerContext``: the contract
is checked at import: the source of the ``worker_serve`` this mirrors must be the one
it was written from (its digest, per tested version: ``MIRRORED``), and the
constructors must take what it passes them. ``pyproject.toml`` pins hypercorn to the
tested release. When the contract does not hold, ``serve`` refuses to start while
``server.max_connections`` is set (``GuardUnavailable``, naming the setting that turns
the cap off: mlxd does not run without a cap it was told to keep); with the cap off it
is ``hypercorn.trio.serve`` unguarded (no HTTP/2 idle close), with one warning.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from importlib.metadata import version
from typing import Any

import hypercorn.trio.run
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.statsd import StatsdLogger
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import ShutdownError, raise_shutdown, repr_socket_addr, wrap_app

log = logging.getLogger("mlxd.http")

H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_LINGER_S = 1.0  # the most a refused connection is held open
# hypercorn's versions whose ``worker_serve`` ``_worker_serve`` mirrors, each with the
# sha256 of that function's source (``inspect.getsource``) as the tested release has it
MIRRORED = {"0.18.0": "8dc8347a9fc357ca334f8c3e4bcf0368176510a96d434f21a5eb4c9ec4103726"}
_REFUSAL = (
    b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
)
_REFUSAL_BODY = (
    b'{"error":{"message":"too many open connections (server.max_connections); retry later",'
    b'"type":"server_error","param":null,"code":"too_many_connections"}}'
)


def _digest(function: Callable[..., Any]) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


def _contract() -> str | None:
    """Why the guarded server cannot run on this hypercorn (None: it can)."""
    found = version("hypercorn")
    if found not in MIRRORED:
        return f"hypercorn {found} is not the tested {', '.join(MIRRORED)}"
    if _digest(hypercorn.trio.run.worker_serve) != MIRRORED[found]:
        return f"hypercorn {found}'s worker_serve is not the source mlxd's server mirrors"
    expected = {
        TCPServer: ["app", "config", "context", "state", "stream"],
        Lifespan: ["app", "config", "state"],
        WorkerContext: ["max_requests"],
    }
    for cls, names in expected.items():
        if list(inspect.signature(cls).parameters) != names:
            return f"hypercorn's {cls.__name__} takes {inspect.signature(cls)}"
    return None


BROKEN = _contract()


class GuardUnavailable(ValueError):
    """``server.max_connections`` is set, and the guard that enforces it cannot run."""


def _unguarded(why: str, limit: int) -> GuardUnavailable:
    return GuardUnavailable(
        f"server.max_connections = {limit} needs mlxd's connection guard, which cannot run "
        f"here ({why}); install the hypercorn pyproject.toml pins, or set "
        "server.max_connections = 0 to serve without a connection cap (and without the "
        "HTTP/2 idle close)"
    )


class ConnectionGuard:
    """A trio stream as ``TCPServer`` uses it (``socket``, receive, send, close, and no
    ``do_handshake``: plain TCP), that ends an HTTP/2 connection ``idle_s`` after its
    preface: ``receive_some`` then returns ``b""``, which hypercorn takes for the
    client's close. Every other connection passes through untouched."""

    def __init__(self, stream: trio.SocketStream, idle_s: float):
        self._stream, self.socket = stream, stream.socket
        self._idle_s = idle_s
        self._head: bytes | None = b""  # the first bytes, until they show the protocol
        self._deadline = math.inf

    @property
    def http2(self) -> bool:
        return self._deadline < math.inf

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        with trio.move_on_at(self._deadline):
            data = await self._stream.receive_some(max_bytes)
            self._watch(data)
            return data
        return b""  # the HTTP/2 connection's time is up: as if the client had closed it

    def _watch(self, data: bytes) -> None:
        if self._head is None:
            return
        self._head += data
        if H2_PREFACE.startswith(self._head) and data:
            return  # a preface still arriving
        if self._head.startswith(H2_PREFACE):
            self._deadline = trio.current_time() + self._idle_s
        self._head = None

    async def send_all(self, data: bytes) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()


@dataclass
class Connections:
    """Open connections, counted against ``limit`` (0: no cap)."""

    limit: int = 0
    open: int = 0
    refused: int = 0

    def enter(self) -> bool:
        if self.limit and self.open >= self.limit:
            self.refused += 1
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1


async def _connection(
    server: Callable[[ConnectionGuard], Awaitable[None]],
    connections: Connections,
    idle_s: float,
    stream: trio.SocketStream,
) -> None:
    if not connections.enter():
        await _refuse(stream)
        return
    try:
        await server(ConnectionGuard(stream, idle_s))
    finally:
        connections.leave()


async def _refuse(stream: trio.SocketStream) -> None:
    """503, then a lingering close: the request is read and dropped until the client
    closes, so that the close does not reset the connection before the client has read
    the 503 (all bounded: a client may read or close nothing)."""
    with trio.move_on_after(_LINGER_S) as bounded:
        bounded.shield = True
        try:
            await stream.send_all(_REFUSAL % (len(_REFUSAL_BODY), _REFUSAL_BODY))
            await stream.send_eof()
            while await stream.receive_some(4096):
                pass
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    await trio.aclose_forcefully(stream)


async def serve(
    app: Any,
    config: Config,
    connections: Connections,
    *,
    shutdown_trigger: Callable[..., Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` as ``hypercorn.trio.serve`` does, each connection guarded and counted.
    Where hypercorn's contract does not hold: ``GuardUnavailable`` with a connection cap,
    else unguarded with one warning."""
    if BROKEN is not None:
        if connections.limit:
            raise _unguarded(BROKEN, connections.limit)
        log.warning("connections unguarded (no HTTP/2 idle close, no max_connections): %s", BROKEN)
        await hypercorn_serve(
            app, config, shutdown_trigger=shutdown_trigger, task_status=task_status
        )
        return
    await _worker_serve(
        wrap_app(app, config.wsgi_max_body_size, "asgi"),
        config,
        connections,
        shutdown_trigger,
        task_status,
    )


async def _worker_serve(
    app, config: Config, connections: Connections, shutdown_trigger, task_status
) -> None:
    """hypercorn 0.18's ``worker_serve``, plain TCP only, with ``_connection`` around
    ``TCPServer``."""
    config.set_statsd_logger_class(StatsdLogger)
    state: dict = {}
    lifespan = Lifespan(app, config, state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as server_nursery:
            listeners, binds = _listeners(config)
            task_status.started(binds)
            server = partial(TCPServer, app, config, context, ConnectionState(state.copy()))
            handler = partial(_connection, server, connections, config.keep_alive_timeout)
            try:
                async with trio.open_nursery(strict_exception_groups=True) as nursery:
                    nursery.start_soon(raise_shutdown, shutdown_trigger)
                    nursery.start_soon(raise_shutdown, context.terminate.wait)
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners, handler, listeners, handler_nursery=server_nursery
                        )
                    )
                    await trio.sleep_forever()
            except BaseExceptionGroup as error:
                _, other_errors = error.split((ShutdownError, KeyboardInterrupt))
                if other_errors is not None:
                    raise other_errors from None
            finally:
                await context.terminated.set()
                server_nursery.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


def _listeners(config: Config) -> tuple[list[trio.SocketListener], list[str]]:
    sockets = config.create_sockets()
    if sockets.secure_sockets or sockets.quic_sockets:
        raise ValueError("mlxd's server binds plain TCP only (no TLS or QUIC)")
    listeners, binds = [], []
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
        listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
        binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
    return listeners, binds
