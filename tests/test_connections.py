"""How HTTP connections end, over raw sockets to the app behind hypercorn (fake runner).

``Connection: close`` and HTTP/1.0 requests get their socket closed after the response
(an HTTP/1.0 stream ends with it); a refused method whose body arrives after its
headers leaves a keep-alive connection that answers its next request; a request body
that stalls is cut off at ``server.body_timeout_s`` and the connection closed
(``daemon/connections.py``). Every wait is bounded generously: a hang fails the test,
a slow machine does not.
"""

from __future__ import annotations

import json
import os

import hypercorn.trio.run
import pytest
import trio
from mlxd.daemon import hypercorn_serve
from mlxd.daemon.cli import _startup_cause

from tests.conftest import real_server, settings_with

WAIT_S = 60.0  # a hang, not a slow machine
CHAT = "/v1/chat/completions"
BODY = json.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}).encode()


async def connect(url: str) -> trio.SocketStream:
    host, port = url.removeprefix("http://").split(":")
    return await trio.open_tcp_stream(host, int(port))


async def read_until_closed(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection (a hang fails)."""
    got = b""
    with trio.fail_after(WAIT_S):
        while chunk := await stream.receive_some(65536):
            got += chunk
    return got


async def read_response(stream: trio.SocketStream, buffer: bytearray) -> bytes:
    """One whole response with a Content-Length (the connection stays open)."""
    with trio.fail_after(WAIT_S):
        while b"\r\n\r\n" not in buffer:
            buffer += await stream.receive_some(65536)
        head, _, _ = bytes(buffer).partition(b"\r\n\r\n")
        size = int(next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length"))
                   .split(b":")[1])  # fmt: skip
        while len(buffer) < len(head) + 4 + size:
            buffer += await stream.receive_some(65536)
    end = len(head) + 4 + size
    response = bytes(buffer[:end])
    del buffer[:end]
    return response


def request(method: str, path: str, *headers: str, version: str = "1.1", body=b"") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", *headers]
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.mark.parametrize(
    ("method", "version", "close"),
    [("GET", "1.1", True), ("HEAD", "1.1", True), ("GET", "1.0", False), ("HEAD", "1.0", False)],
)
async def test_connection_close_and_http_1_0_get_the_socket_closed(method, version, close):
    """Health checkers wait for the close (it used to stay open until they gave up)."""
    async with real_server() as (url, _, _):
        stream = await connect(url)
        headers = ["Host: localhost", *(["Connection: close"] if close else [])]
        await stream.send_all(request(method, "/health", *headers, version=version))
        response = await read_until_closed(stream)
    assert response.startswith(b"HTTP/1.1 200")
    assert response.endswith(b'{"status":"ready"}') == (method == "GET")


async def test_an_http_1_0_client_sees_the_end_of_a_stream():
    async with real_server() as (url, _, _):
        stream = await connect(url)
        body = json.dumps({**json.loads(BODY), "stream": True}).encode()
        await stream.send_all(request("POST", CHAT, version="1.0", body=body))
        response = await read_until_closed(stream)
    assert response.startswith(b"HTTP/1.1 200")
    assert response.rstrip().endswith(b"data: [DONE]")


@pytest.mark.parametrize("method", ["TRACE", "QUERY"])
async def test_a_refused_method_with_a_body_leaves_the_connection_answering(method):
    """The 405 is ready before the body has arrived; the connection must still answer the
    next request (it used to leave it unanswered, and the socket open)."""
    async with real_server() as (url, _, _):
        stream = await connect(url)
        head, _, body = request(method, CHAT, "Host: localhost", body=BODY).partition(b"\r\n\r\n")
        await stream.send_all(head + b"\r\n\r\n")
        buffer = bytearray()
        with trio.fail_after(WAIT_S):  # the 405's status line goes out before the body arrives
            while b"\r\n\r\n" not in buffer:
                buffer += await stream.receive_some(65536)
        await trio.sleep(0.2)  # time for the rest of the 405 to go out too, if it does
        await stream.send_all(body)
        refused = await read_response(stream, buffer)
        await stream.send_all(request("GET", "/health", "Host: localhost"))
        answered = await read_response(stream, buffer)
        await stream.aclose()
    assert refused.startswith(b"HTTP/1.1 405")
    assert answered.startswith(b"HTTP/1.1 200") and answered.endswith(b'{"status":"ready"}')


STALLED = {
    "Content-Length past the body": (
        b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + BODY[:20],
        b"HTTP/1.1 408",
    ),
    "a lying chunk size": (
        b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"100\r\n" + BODY[:20],
        b"HTTP/1.1 408",
    ),
    "a body the route never reads": (
        b"TRACE /health HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{}",
        b"HTTP/1.1 405",
    ),
}


@pytest.mark.parametrize("name", list(STALLED))
async def test_a_stalled_body_is_cut_off_at_body_timeout_s(name):
    data, status = STALLED[name]
    settings = settings_with(server={"body_timeout_s": 0.5})
    async with real_server(settings) as (url, _, _):
        stream = await connect(url)
        await stream.send_all(data)
        response = await read_until_closed(stream)  # answered, then closed
    assert response.startswith(status), response[:200]
    if status == b"HTTP/1.1 408":
        assert json.loads(response.partition(b"\r\n\r\n")[2])["error"]["type"]


# ---- HTTP/2, which mlxd refuses, and the connection cap (daemon/hypercorn_serve.py) ----------

H2_OPENING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + SETTINGS
IDLE_S = 0.5


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


async def refused_http2(url: str) -> bytes:
    """An HTTP/2 connection that sends its preface and an empty SETTINGS, then nothing:
    what the server sends until it closes it (a hang fails)."""
    stream = await connect(url)
    try:
        await stream.send_all(H2_OPENING)
        return await read_until_closed(stream)
    finally:
        await stream.aclose()


async def test_an_http2_connection_is_closed_at_the_idle_timeout():
    """It used to stay open for ever: hypercorn starts no idle timer on an HTTP/2
    connection without a stream, and mlxd allows none."""
    settings = settings_with(server={"idle_timeout_s": IDLE_S})
    async with real_server(settings) as (url, _, _):
        start = trio.current_time()
        answer = await refused_http2(url)
        waited = trio.current_time() - start
    assert answer[3] == 4  # the server's SETTINGS frame (max concurrent streams 0)
    assert waited >= IDLE_S  # closed by the timeout, not at once


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
async def test_500_refused_http2_connections_leave_the_descriptor_count_where_it_was():
    settings = settings_with(server={"idle_timeout_s": IDLE_S, "max_connections": 0})
    async with real_server(settings) as (url, _, _):
        before = open_descriptors()
        async with trio.open_nursery() as nursery:
            for _ in range(500):
                nursery.start_soon(refused_http2, url)
        with trio.fail_after(WAIT_S):  # the server closes its ends right after their EOF
            while open_descriptors() > before:
                await trio.sleep(0.01)


async def test_a_connection_past_max_connections_gets_a_503_and_http2_ones_count():
    settings = settings_with(server={"idle_timeout_s": WAIT_S, "max_connections": 2})
    async with real_server(settings) as (url, _, _):
        held = [await connect(url) for _ in range(2)]
        for stream in held:
            await stream.send_all(H2_OPENING)
            with trio.fail_after(WAIT_S):  # the server's SETTINGS: it has taken the connection
                await stream.receive_some(65536)
        extra = await connect(url)
        await extra.send_all(request("GET", "/health", "Host: localhost"))
        refused = await read_until_closed(extra)
        for stream in held:
            await stream.aclose()
        with trio.fail_after(WAIT_S):  # the server notices the closes
            while (answer := await health(url)).startswith(b"HTTP/1.1 503"):
                await trio.sleep(0.01)
    assert refused.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in refused
    error = json.loads(refused.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "too_many_connections" and "server.max_connections" in error["message"]
    assert answer.startswith(b"HTTP/1.1 200")


async def health(url: str) -> bytes:
    stream = await connect(url)
    await stream.send_all(request("GET", "/health", "Host: localhost", "Connection: close"))
    return await read_until_closed(stream)


def test_the_guard_holds_on_the_installed_hypercorn_and_not_on_an_untested_one(monkeypatch):
    assert hypercorn_serve.BROKEN is None
    monkeypatch.setattr(hypercorn_serve, "version", lambda _: "0.19.0")
    assert "hypercorn 0.19.0 is not the tested 0.18.0" in hypercorn_serve._contract()


def test_the_contract_is_the_source_of_the_mirrored_function(monkeypatch):
    """Same version and constructors, but a worker_serve that is not the one mirrored."""
    original = hypercorn_serve.inspect.getsource

    def changed(obj):
        text = original(obj)
        return text + "    # changed\n" if obj is hypercorn.trio.run.worker_serve else text

    monkeypatch.setattr(hypercorn_serve.inspect, "getsource", changed)
    assert "worker_serve is not the source" in hypercorn_serve._contract()


async def test_out_of_contract_with_max_connections_it_refuses_to_start(monkeypatch):
    monkeypatch.setattr(hypercorn_serve, "BROKEN", "hypercorn 0.19.0 is not the tested 0.18.0")
    with pytest.raises(BaseExceptionGroup) as refused:
        async with real_server(settings_with(server={"max_connections": 8})):
            pass
    cause = _startup_cause(refused.value)  # what `mlxd serve` reports, on one line
    assert isinstance(cause, hypercorn_serve.GuardUnavailable)
    message = str(cause)
    assert "server.max_connections = 8" in message and "hypercorn 0.19.0" in message
    assert "server.max_connections = 0" in message  # the setting that turns it off


async def test_out_of_contract_without_a_cap_it_serves_through_plain_hypercorn_with_one_warning(
    monkeypatch, caplog
):
    monkeypatch.setattr(hypercorn_serve, "BROKEN", "hypercorn 0.19.0 is not the tested 0.18.0")
    async with real_server(settings_with(server={"max_connections": 0})) as (url, _, _):
        answer = await health(url)
    assert answer.startswith(b"HTTP/1.1 200")
    assert caplog.text.count("connections unguarded") == 1
