"""Streaming keep-alive: while a long prompt prefills, each API's stream sends its
keep-alive frame every ``streaming.keepalive_s`` and is otherwise unchanged.

The fake runner's prefill blocks after its first chunk until the client has seen a
keep-alive (bounded by a generous timeout): the test passes only if one arrives while
the prompt is still prefilling, however fast or slow the machine is."""

from __future__ import annotations

import re
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from mlxd.daemon.app import create_app

from tests.conftest import running_graph, settings_with
from tests.fakes import FakeRunner
from tests.test_openai_features import read_stream

GATE_TIMEOUT_S = 60.0
PROMPT = "please answer this fairly long question about keeping streams alive " * 2


@dataclass
class SlowPrefill(FakeRunner):
    """Prefills its first chunk, then waits for ``gate`` (the test opens it once the client
    has a keep-alive); a prefill that waits in vain fails its request."""

    gate: threading.Event = field(default_factory=threading.Event)
    chunks: int = 0

    def prefill(self, request_id: str, budget: int) -> int:
        self.chunks += 1
        if self.chunks > 1 and not self.gate.wait(GATE_TIMEOUT_S):
            raise RuntimeError("no keep-alive reached the client during the prefill")
        return super().prefill(request_id, budget)


ANTHROPIC = {"x-api-key": "anything", "anthropic-version": "2023-06-01"}
CASES = {
    "anthropic": (
        "/v1/messages",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40},
        ANTHROPIC,
        b'event: ping\ndata: {"type":"ping"}\n\n',
    ),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 40},
        {},
        b": keep-alive\n\n",
    ),
    "completions": (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 40},
        {},
        b": keep-alive\n\n",
    ),
    "responses": (
        "/v1/responses",
        {"input": PROMPT, "max_output_tokens": 40},
        {},
        b": keep-alive\n\n",
    ),
}


@asynccontextmanager
async def app_client(keepalive_s: float, runner: FakeRunner):
    settings = settings_with(
        streaming={"keepalive_s": keepalive_s}, engine={"prefill_chunk_tokens": 8}
    )
    async with running_graph(settings, runner=runner) as (pipeline, _):
        yield create_app(pipeline, settings).test_client()


def frames(raw: bytes, keepalive: bytes) -> list[str]:
    """The stream's frames without its keep-alives, ids and clock readings."""
    text = raw.decode()
    if keepalive.startswith(b":"):
        text = text.replace(keepalive.decode(), "")
    text = re.sub(r'"(created|created_at)":\d+', '"created":0', text)
    text = re.sub(r"\b(msg|resp|chatcmpl|cmpl|rs|fc|call)[_-][0-9a-zA-Z]+", "ID", text)
    return [f for f in text.split("\n\n") if f]


@pytest.mark.parametrize("api", list(CASES))
async def test_a_long_prefill_sends_keepalives_and_nothing_else_changes(api):
    path, body, headers, keepalive = CASES[api]
    runner = SlowPrefill(step_delay=0)

    def open_gate_on_keepalive(data: bytes) -> None:
        if data.count(keepalive) > (1 if api == "anthropic" else 0):  # message_start's ping
            runner.gate.set()

    async with app_client(0.05, runner) as c:
        raw = await read_stream(c, path, body, headers, open_gate_on_keepalive)
    assert runner.gate.is_set() and runner.chunks > 2  # it waited, then prefilled on
    assert b"no keep-alive" not in raw
    first_output = re.search(rb'"(text|content|delta)":"P', raw)  # "PLEASE ...": the reply
    assert first_output is not None
    before = raw[: first_output.start()].count(keepalive)
    assert before >= (2 if api == "anthropic" else 1)

    quiet = SlowPrefill(step_delay=0)
    quiet.gate.set()
    async with app_client(0.0, quiet) as c:
        reference = await read_stream(c, path, body, headers)
    assert keepalive.startswith(b":") == (api != "anthropic")
    assert reference.count(keepalive) == (1 if api == "anthropic" else 0)
    got = frames(raw, keepalive)
    if api == "anthropic":  # the extra pings are whole frames: drop all but message_start's
        ping = keepalive.decode().strip()
        first = got.index(ping)
        got = got[: first + 1] + [f for f in got[first + 1 :] if f != ping]
    assert got == frames(reference, keepalive)
