"""Nothing one request does takes down an actor or holds what others need (fake runner).

An exception in a request's own work (building its prompt, streaming its
output) fails that request only; a client that reads nothing gives its
admission slots back when generation ends; a drain that runs out of time ends
open streams with an error event in each API's format.
"""

from __future__ import annotations

import json
import socket
import threading
from contextlib import asynccontextmanager

import httpx
import mlxd.actors.streamer as streamer_module
import msgspec
import pytest
import trio
import trio.testing
from hypercorn.trio import serve
from mlxd.actors.families.output import OutputParser
from mlxd.actors.mailbox import Mailbox, merge_deltas
from mlxd.actors.tokenizer import PromptError
from mlxd.daemon.app import create_app
from mlxd.daemon.supervisor import drain, http_config
from mlxd.protocol.messages import Failed, Finished, OutputSpec, TextDelta

from tests.conftest import chat, collect, real_server, running_graph, settings_with, text_of

WAIT_S = 60.0  # a hang, not a slow machine

_NEST = "[" * 5000 + "]" * 5000


def deep(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


def with_kwargs(rid: str, text: str, **kwargs) -> object:
    return msgspec.structs.replace(chat(rid, text), template_kwargs=kwargs)


# ---- per-request failures -----------------------------------------------------------------


async def test_recursion_while_building_a_prompt_is_that_requests_400():
    async with running_graph() as (pipeline, _):
        bad = await pipeline.submit(with_kwargs("deep", "hi", x=deep(5000)))
        good = await pipeline.submit(chat("good", "fine"))
        failed = (await collect(bad))[-1]
        assert text_of(await collect(good)) == "FINE"
        with pytest.raises(PromptError, match="nested too deeply"):
            await pipeline.count_tokens(with_kwargs("count", "hi", x=deep(5000)))
    assert isinstance(failed, Failed)
    assert failed.reason == "too_deeply_nested"


async def test_a_bug_while_building_a_prompt_is_that_requests_500(monkeypatch, caplog):
    async with running_graph() as (pipeline, _):
        encode = pipeline.builder._encode

        def buggy(text):
            if "BOOM" in text:
                raise ZeroDivisionError("scripted")
            return encode(text)

        monkeypatch.setattr(pipeline.builder, "_encode", buggy)
        bad = await pipeline.submit(chat("bad", "BOOM"))
        failed = (await collect(bad))[-1]
        assert text_of(await collect(await pipeline.submit(chat("after", "ok")))) == "OK"
    assert isinstance(failed, Failed)
    assert failed.reason == "internal_error"
    assert "ZeroDivisionError: scripted" in failed.message
    assert "building the prompt failed" in caplog.text


async def test_a_request_whose_client_left_while_queued_is_never_built(monkeypatch):
    settings = settings_with(tokenizer={"workers": 1})
    async with running_graph(settings) as (pipeline, _):
        build, built = pipeline.builder.build, []

        entered, release = threading.Event(), threading.Event()

        def slow_build(request):
            built.append(request.request_id)
            if request.request_id == "slow":
                entered.set()
                release.wait(WAIT_S)  # holds the only worker
            return build(request)

        monkeypatch.setattr(pipeline.builder, "build", slow_build)
        slow = await pipeline.submit(chat("slow", "a"))
        await trio.to_thread.run_sync(entered.wait, WAIT_S)
        gone = await pipeline.submit(chat("gone", "b"))
        await trio.testing.wait_all_tasks_blocked()  # "gone" waits for the worker
        await gone.close()  # the client leaves while waiting for the worker
        release.set()
        assert text_of(await collect(slow)) == "A"
        assert text_of(await collect(await pipeline.submit(chat("next", "c")))) == "C"
    assert built == ["slow", "next"]


class _BuggyParser(OutputParser):
    def feed(self, text):
        if "X" in text:
            raise KeyError("scripted")
        return super().feed(text)


async def test_a_bug_while_streaming_fails_only_that_request(monkeypatch):
    monkeypatch.setattr(streamer_module, "OutputParser", _BuggyParser)
    async with running_graph() as (pipeline, runner):
        runner.step_delay = 0.002
        bad = await pipeline.submit(chat("bad", "a" * 20 + "x" + "a" * 200))
        good = await pipeline.submit(chat("good", "b" * 50))
        failed = await collect(bad)
        assert text_of(await collect(good)) == "B" * 50
    # leaving running_graph asserted the engine idle: the failed sequence was aborted
    assert isinstance(failed[-1], Failed) and failed[-1].reason == "internal_error"
    assert "KeyError" in failed[-1].message


# Model output an attacker can ask for: JSON escapes that are not JSON's, nesting past
# the recursion limit. Each parser hands such text back as content (never raises).
HOSTILE_OUTPUT = {
    "hermes": [
        '<tool_call>\n{"name": "a\\x", "arguments": {"q": 1}}\n</tool_call>',
        '<tool_call>\n{"name": "f", "arguments": ' + _NEST + "}\n</tool_call>",
    ],
    "mistral": ["[TOOL_CALLS]f[ARGS]" + '{"a":' * 3000 + "1" + "}" * 3000],
    "llama3": ['<|python_tag|>{"name": "f", "parameters": ' + _NEST + "}"],
    "json": [_NEST],
}


@pytest.mark.parametrize(
    ("fmt", "text"), [(f, t) for f, texts in HOSTILE_OUTPUT.items() for t in texts]
)
def test_output_parsers_survive_hostile_model_output(fmt, text):
    parser = OutputParser(OutputSpec(tool_format=fmt))
    parsed = parser.feed(text)
    parsed.extend(parser.flush())
    assert all(c.arguments in ("", '{"q": 1}') for c in parsed.calls)


# ---- slots follow the generation, not the client ------------------------------------------


async def test_unread_request_frees_its_slot_when_generation_ends():
    settings = settings_with(admission={"max_running": 1, "max_waiting": 4})
    async with running_graph(settings) as (pipeline, _):
        unread = await pipeline.submit(chat("unread", "abc"))  # nobody reads it
        with trio.fail_after(WAIT_S):
            assert text_of(await collect(await pipeline.submit(chat("next", "def")))) == "DEF"
        assert unread.mailbox.take()[-1].finish_reason == "stop"
        await unread.close()


def test_a_mailbox_nobody_reads_merges_its_deltas():
    box = Mailbox("r")
    for i in range(1000):
        box.put(TextDelta(text=str(i % 10), tokens=1))
    assert len(box._deltas) < 64
    (merged,) = box.take()
    assert merged == merge_deltas([TextDelta(text=str(i % 10), tokens=1) for i in range(1000)])


def test_a_mailbox_past_max_unread_drops_its_output_and_fails():
    ended = []
    box = Mailbox("r", on_final=ended.append, max_unread=100)
    for _ in range(10):
        box.put(TextDelta(text="x" * 9, tokens=1))
    assert box.take()[0].text == "x" * 90  # taking resets the count
    for _ in range(12):
        box.put(TextDelta(text="x" * 9, tokens=1))
    (failed,) = box.take()
    assert failed.reason == "client_not_reading"
    assert ended == [box]


async def _status(http: httpx.AsyncClient) -> dict:
    return (await http.get("/v1/status")).json()


# Eight streamed choices with big chunks: far more than the socket buffers hold.
UNREAD = {
    "messages": [{"role": "user", "content": "!" + "y" * 1500}],
    "n": 8,
    "stream": True,
    "max_tokens": 1500,
    "logprobs": True,
    "top_logprobs": 20,
}


@asynccontextmanager
async def unread_stream(url: str):
    """A raw connection that sends ``UNREAD`` and never reads; closed on exit."""
    host, port = url.removeprefix("http://").split(":")
    raw = trio.socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with raw:
        await raw.connect((host, int(port)))
        payload = json.dumps(UNREAD).encode()
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
        await raw.send(head.encode() + payload)
        yield


async def test_a_client_that_reads_nothing_gives_its_slots_back():
    """hypercorn's write to the client blocks (the handler with it), yet the slots come
    back when the generation ends (here at the request's deadline)."""
    settings = settings_with(
        # the deadline ends the unread generations: long enough for all 8 to be running first
        admission={"max_running": 8, "max_waiting": 0, "request_timeout_s": 3.0}
    )
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    async with real_server(settings) as (url, pipeline, runner):
        runner.step_delay = 0.0
        async with unread_stream(url), httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http:
            with trio.fail_after(WAIT_S):
                while (await _status(http))["admission"]["running"] < 8:
                    await trio.sleep(0.02)
            assert (await http.post("/v1/chat/completions", json=hi)).status_code == 429
            with trio.fail_after(WAIT_S):
                while (await _status(http))["admission"]["running"]:
                    await trio.sleep(0.05)
            # The handler is still stuck writing to the client: its sessions are open.
            assert len(pipeline.sessions) == 8
            served = await http.post("/v1/chat/completions", json=hi)
            assert served.status_code == 200
            assert served.json()["choices"][0]["message"]["content"] == "HI"
            assert (await _status(http))["admission"]["running"] == 0


async def test_a_client_that_reads_nothing_is_stopped_past_max_unread_bytes():
    settings = settings_with(
        admission={"max_running": 8, "max_waiting": 0}, streaming={"max_unread_bytes": 65536}
    )
    async with real_server(settings) as (url, pipeline, runner):
        runner.step_delay = 0.005  # 1500 steps: longer than the test waits
        async with unread_stream(url), httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http:
            with trio.fail_after(WAIT_S):
                while (await _status(http))["admission"]["running"] < 8:
                    await trio.sleep(0.02)
            with trio.fail_after(WAIT_S):  # each choice fails once 64 KiB wait unread
                while (await _status(http))["admission"]["running"]:
                    await trio.sleep(0.05)
            sizes = [box._unread for box in map(pipeline.mailboxes.get, pipeline.sessions) if box]
            assert max(sizes, default=0) <= 65536
        # stopped at ~50 tokens (1.3 KB each with 20 logprobs), not at max_tokens' 1500
        assert runner.decode_steps < 1500


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux only")
async def test_a_client_that_reads_nothing_is_cut_off_after_send_timeout_s():
    settings = settings_with(server={"send_timeout_s": 1.0, "port": 0, "host": "127.0.0.1"})
    async with running_graph(settings) as (pipeline, runner), trio.open_nursery() as nursery:
        runner.step_delay = 0.0
        binds = await nursery.start(serve, create_app(pipeline, settings), http_config(settings))
        async with unread_stream(binds[0]):
            with trio.fail_after(WAIT_S):
                while len(pipeline.sessions) < 8:
                    await trio.sleep(0.02)
            with trio.fail_after(WAIT_S):  # the kernel aborts the connection; the handler ends
                while pipeline.sessions:
                    await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


# ---- drain cut-off ------------------------------------------------------------------------

LONG = [{"role": "user", "content": "z" * 1500}]
STREAMS = {
    "openai": ("/v1/chat/completions", {"messages": LONG, "stream": True}),
    "completions": ("/v1/completions", {"prompt": "z" * 1500, "stream": True}),
    "anthropic": ("/v1/messages", {"messages": LONG, "stream": True, "max_tokens": 2000}),
    "responses": ("/v1/responses", {"input": "z" * 1500, "stream": True}),
    "ollama": ("/api/chat", {"model": "m", "messages": LONG, "stream": True}),
}


def sse_frames(text: str) -> list[tuple[str | None, dict | str]]:
    """(event name, data) of each SSE frame; ``data: [DONE]`` stays a string."""
    frames = []
    for block in text.split("\n\n"):
        if not block.strip() or block.startswith(":"):
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = lines["data"]
        frames.append((lines.get("event"), data if data == "[DONE]" else json.loads(data)))
    return frames


def cut_off_codes(name: str, text: str) -> list[str]:
    """The reason codes the end of a cut-off stream names, in the API's own places."""
    if name == "ollama":  # NDJSON: the last line is the error
        last = json.loads(text.strip().rsplit("\n", 1)[-1])
        assert set(last) == {"error", "code"} and "drain_timeout_s" in last["error"]
        return [last["code"]]
    frames = sse_frames(text)
    if name in ("openai", "completions"):
        assert frames[-1] == (None, "[DONE]")
        error = frames[-2][1]["error"]
        assert error["type"] == "service_unavailable" and "drain_timeout_s" in error["message"]
        return [error["code"]]
    if name == "anthropic":
        event, body = frames[-1]
        assert event == "error" and body["error"]["type"] == "overloaded_error"
        return [body["error"]["details"]["error_code"]]
    (event, error), (last, failed) = frames[-2:]
    assert (event, last) == ("error", "response.failed")
    assert failed["response"]["error"]["type"] == "service_unavailable"
    assert "shutting down" in failed["response"]["error"]["message"]
    return [error["code"], failed["response"]["error"]["code"]]


async def test_drain_cut_off_ends_open_streams_with_an_error_event():
    settings = settings_with(engine={"default_max_tokens": 3000})
    ends: dict[str, str] = {}
    async with real_server(settings) as (url, pipeline, runner):
        runner.step_delay = 0.01
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as http:

            async def stream(name, started):
                path, body = STREAMS[name]
                async with http.stream("POST", path, json=body) as r:
                    assert r.status_code == 200
                    chunks = r.aiter_raw()
                    text = (await anext(chunks)).decode()
                    started.set()
                    async for chunk in chunks:
                        text += chunk.decode()
                ends[name] = text

            async with trio.open_nursery() as nursery:
                for name in STREAMS:
                    started = trio.Event()
                    nursery.start_soon(stream, name, started)
                    await started.wait()
                with trio.fail_after(WAIT_S):
                    await drain(pipeline, deadline_s=0.1)
        with trio.fail_after(WAIT_S):  # each handler closes its session after its last frame
            while len(pipeline.mailboxes):
                await trio.sleep(0.01)
    # One code for the cut-off in every API: chat's error ``code`` is everyone's.
    codes = {name: cut_off_codes(name, text) for name, text in ends.items()}
    assert codes == {
        "openai": ["shutting_down"],
        "completions": ["shutting_down"],
        "anthropic": ["shutting_down"],
        "responses": ["shutting_down", "shutting_down"],
        "ollama": ["shutting_down"],
    }


async def test_drain_cut_off_before_the_first_token_is_a_503():
    async with running_graph() as (pipeline, runner):
        runner.step_delay = 0.01
        busy = await pipeline.submit(chat("busy", "q" * 3000))
        with trio.fail_after(WAIT_S):
            await drain(pipeline, deadline_s=0.05)
        events = await collect(busy)
    assert isinstance(events[-1], Failed) and events[-1].reason == "shutting_down"
    assert not any(isinstance(e, Finished) for e in events)


async def test_a_request_cut_off_while_tokenizing_never_reaches_the_engine(monkeypatch):
    async with running_graph() as (pipeline, runner):
        build = pipeline.builder.build
        entered, release, built = threading.Event(), threading.Event(), threading.Event()

        def slow_build(request):
            entered.set()
            release.wait(WAIT_S)
            try:
                return build(request)
            finally:
                built.set()

        monkeypatch.setattr(pipeline.builder, "build", slow_build)
        session = await pipeline.submit(chat("slow", "a"))
        await trio.to_thread.run_sync(entered.wait, WAIT_S)  # tokenizing
        await drain(pipeline, deadline_s=0)
        release.set()  # the build finishes while the session is still open
        await trio.to_thread.run_sync(built.wait, WAIT_S)
        await trio.testing.wait_all_tasks_blocked()  # the tokenizer has handed it on, or not
        events = await collect(session)
    assert isinstance(events[-1], Failed) and events[-1].reason == "shutting_down"
    assert "slow" not in {rid for rid, _ in runner.prefill_log}
