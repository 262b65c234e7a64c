"""Hostile clients against a real `mlxd serve` process (SmolLM2, CPU).

While one ordinary greedy stream runs, every payload from issue 11 is sent: out
of range token ids and sampling values, nesting deep enough to overflow a
recursive renderer, bodies that are not JSON, not UTF-8 or too large, a bad
Host, a client that never reads. Each must get a 4xx (never a 5xx, never a
hang), the process must stay up with ``/health`` 200, and the ordinary stream
must produce exactly the tokens it produces alone.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.processes import free_port

pytestmark = pytest.mark.mlx

ROOT = Path(__file__).resolve().parent.parent
CHAT, COUNT, RESPONSES = "/v1/chat/completions", "/v1/messages/count_tokens", "/v1/responses"
USER = [{"role": "user", "content": "Write a short poem about the sea."}]
NORMAL = {"messages": USER, "temperature": 0, "max_tokens": 48, "stream": True, "logprobs": True}
MAX_BODY = 4_194_304  # server.max_body_bytes
UNDER_LIMIT_COUNTS = 4  # 2 MB count_tokens bodies that are tokenized (CPU time on a 2-core box)
CLIENT_S = 600.0  # the test's bound on anything it waits for: a hang, not a slow machine


def _nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def _deep_dict(depth: int) -> dict:
    d: dict = {}
    for _ in range(depth):
        d = {"a": d}
    return d


def _chat(**extra) -> dict:
    return {"messages": USER, "max_tokens": 4, **extra}


def _tool_history(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


def _json(body: object) -> tuple[bytes, dict]:
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


SELF_REF = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
JSON_HEAD = {"Content-Type": "application/json"}

# name → (path, body bytes, headers): each must be answered with a 4xx
PAYLOADS: dict[str, tuple[str, bytes, dict]] = {
    "logit_bias id 10,000,000": (CHAT, *_json(_chat(logit_bias={"10000000": 5}))),
    "logit_bias negative id": (CHAT, *_json(_chat(logit_bias={"-5": 5}))),
    "logit_bias non-integer id": (CHAT, *_json(_chat(logit_bias={"x": 5}))),
    "top_k above vocab": (CHAT, *_json(_chat(top_k=10**9, temperature=1.0))),
    "tool-call arguments 50,000 [": (CHAT, *_json(_chat(messages=_tool_history("[" * 50_000)))),
    "tool-call arguments 50,000 deep": (
        CHAT,
        *_json(_chat(messages=_tool_history(_nested(50_000)))),
    ),
    "chat_template_kwargs 600 deep": (
        CHAT,
        *_json(_chat(chat_template_kwargs={"x": _deep_dict(600)})),
    ),
    "chat_template_kwargs.chat_template": (
        CHAT,
        *_json(_chat(chat_template_kwargs={"chat_template": "{{ range(10**9) | list }}"})),
    ),
    "responses function_call.arguments deep": (
        RESPONSES,
        *_json(
            {
                "max_output_tokens": 4,
                "input": [
                    {"role": "user", "content": "hi"},
                    {
                        "type": "function_call",
                        "call_id": "c1",
                        "name": "f",
                        "arguments": _nested(50_000),
                    },
                    {"type": "function_call_output", "call_id": "c1", "output": "ok"},
                ],
            }
        ),
    ),
    "invalid UTF-8 body": (
        CHAT,
        b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}], "max_tokens": 4}',
        JSON_HEAD,
    ),
    "10,000-deep JSON body": (CHAT, _nested(10_000).encode(), JSON_HEAD),
    "10,000-deep messages": (
        CHAT,
        b'{"messages": ' + _nested(10_000).encode() + b', "max_tokens": 4}',
        JSON_HEAD,
    ),
    "seed -1": (CHAT, *_json(_chat(seed=-1, temperature=1.0))),
    "seed 2**64": (CHAT, *_json(_chat(seed=2**64, temperature=1.0))),
    "recursive $ref json_schema": (
        CHAT,
        *_json(
            _chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "r", "schema": SELF_REF},
                }
            )
        ),
    ),
    "text/plain body": (CHAT, json.dumps(_chat()).encode(), {"Content-Type": "text/plain"}),
    "bad Host header": (
        CHAT,
        json.dumps(_chat()).encode(),
        {**JSON_HEAD, "Host": "attacker.example"},
    ),
    "prompt token id out of range": (
        "/v1/completions",
        *_json({"prompt": [10**9], "max_tokens": 4}),
    ),
    "max_tokens negative": (CHAT, *_json(_chat(max_tokens=-1))),
    "n above max_n": (CHAT, *_json(_chat(n=10**6))),
    "temperature huge": (CHAT, *_json(_chat(temperature=1e308))),
    "top_logprobs huge": (CHAT, *_json(_chat(logprobs=True, top_logprobs=10**6))),
    "10,000 stop strings": (CHAT, *_json(_chat(stop=["x"] * 10_000))),
    "20,000 messages": (CHAT, *_json(_chat(messages=USER * 20_000))),
    "empty messages": (CHAT, *_json(_chat(messages=[]))),
    "not JSON": (CHAT, b"{nope", JSON_HEAD),
    "anthropic tool_use input 600 deep": (
        "/v1/messages",
        *_json(
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "tool_use", "id": "t1", "name": "f", "input": _deep_dict(600)}
                        ],
                    },
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}],
                    },
                ],
            }
        ),
    ),
    "anthropic top_k above vocab": (
        "/v1/messages",
        *_json({"max_tokens": 4, "top_k": 10**9, "messages": USER}),
    ),
    "body over max_body_bytes": (
        CHAT,
        *_json(_chat(messages=[{"role": "user", "content": "x" * MAX_BODY}])),
    ),
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """`mlxd serve` on the default model, on a free loopback port; its log file."""
    tmp = tmp_path_factory.mktemp("hostile")
    port = free_port()
    config = tmp / "mlxd.toml"
    config.write_text(
        f'[model]\ncache_dir = "{tmp / "cache"}"\n'
        # no server-side deadlines: on a busy 2-core box the ordinary stream may take
        # minutes (it once hit a 60 s request_timeout_s); the test's own bounds are generous
        "[admission]\nmax_running = 24\nmax_waiting = 32\n"
        "queue_timeout_s = 0.0\nrequest_timeout_s = 0.0\n"
        "[server]\ndrain_timeout_s = 3.0\nflush_timeout_s = 2.0\nsend_timeout_s = 2.0\n"
    )
    log = tmp / "mlxd.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxd.daemon.cli",
                "serve",
                "--port",
                str(port),
                "--config",
                config,
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:
        url = f"http://127.0.0.1:{port}"
        trio.run(_wait_ready, url, proc)
        yield url, proc, log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _wait_ready(url: str, proc: subprocess.Popen) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=5) as http:
        with trio.fail_after(CLIENT_S):
            while True:
                assert proc.poll() is None, "mlxd exited during start-up"
                try:
                    if (await http.get("/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await trio.sleep(0.25)


async def _stream_tokens(http: httpx.AsyncClient) -> list[str]:
    """The ordinary stream's tokens (from its logprobs), to the end; it must not fail."""
    tokens: list[str] = []
    async with http.stream("POST", CHAT, json=NORMAL) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                tokens += [t["token"] for t in (choice.get("logprobs") or {}).get("content") or []]
    return tokens


async def _non_reading_client(
    url: str, opened: trio.Event, close: trio.Event, max_tokens: int = 24
) -> None:
    """A streamed n=8 request with big chunks whose reader never reads (held until ``close``)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "messages": USER,
            "n": 8,
            "stream": True,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 20,
        }
    ).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    raw = trio.socket.socket()
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with raw:
        await raw.connect((host, int(port)))
        await raw.send(head + body)
        opened.set()
        await close.wait()


async def _attack(url: str, results: dict[str, int], counted: dict[int, int]) -> None:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_S, limits=limits) as http:

        async def one(name: str, path: str, body: bytes, headers: dict) -> None:
            try:
                r = await http.post(path, content=body, headers=headers)
                results[name] = r.status_code
            except httpx.HTTPError as exc:
                results[name] = -1
                results[f"{name}: {type(exc).__name__}"] = -1

        async def count_under_limit(i: int) -> None:
            content = f"{i} " + "tok " * (MAX_BODY // 8)
            r = await http.post(COUNT, json={"messages": [{"role": "user", "content": content}]})
            counted[i] = r.status_code

        async with trio.open_nursery() as nursery:
            for name, (path, body, headers) in PAYLOADS.items():
                nursery.start_soon(one, name, path, body, headers)
            # Twenty 4 MB count_tokens bodies at once (each just over server.max_body_bytes)
            big = json.dumps({"messages": [{"role": "user", "content": "tok " * (MAX_BODY // 4)}]})
            for i in range(20):
                nursery.start_soon(one, f"count_tokens 4 MB #{i}", COUNT, big.encode(), JSON_HEAD)
            # and a few under it, which really are tokenized (200, or 429 when busy)
            for i in range(UNDER_LIMIT_COUNTS):
                nursery.start_soon(count_under_limit, i)


async def _status(http: httpx.AsyncClient) -> dict:
    return (await http.get("/v1/status")).json()


async def _scenario(url: str) -> dict:
    out: dict = {}
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_S) as http:
        out["alone"] = await _stream_tokens(http)
        opened, close = trio.Event(), trio.Event()
        results: dict[str, int] = {}
        out["counted"] = {}
        async with trio.open_nursery() as nursery:
            normal_done = trio.Event()

            async def normal() -> None:
                out["attacked"] = await _stream_tokens(http)
                normal_done.set()

            nursery.start_soon(normal)
            nursery.start_soon(_non_reading_client, url, opened, close)
            await opened.wait()
            vanished = trio.Event()
            vanished.set()  # a client that sends a streamed n=8 request and leaves at once
            nursery.start_soon(_non_reading_client, url, trio.Event(), vanished, 200)
            with trio.fail_after(CLIENT_S):
                await _attack(url, results, out["counted"])
            await normal_done.wait()
            # The client that never reads: its slots come back when its generation ends.
            with trio.move_on_after(CLIENT_S):
                while (await _status(http))["admission"]["running"]:
                    await trio.sleep(0.2)
            status = await _status(http)
            out["running_with_unread_client_open"] = status["admission"]["running"]
            out["unread_sessions_open"] = sum(map(len, status["requests"].values()))
            close.set()
        out["results"] = results
        sampled = await http.post(
            CHAT, json={"messages": USER, "max_tokens": 8, "temperature": 0.9}
        )
        out["unseeded_sampling_after"] = sampled.status_code
        out["health"] = (await http.get("/health")).status_code
        out["final_status"] = await _status(http)
    return out


def test_hostile_payloads_get_4xx_and_harm_no_one(daemon):
    url, proc, log = daemon
    out = trio.run(_scenario, url)
    results = out["results"]
    bad = {name: status for name, status in results.items() if not 400 <= status < 500}
    report = "\n".join(f"  {status:>4}  {name}" for name, status in sorted(results.items()))
    assert not bad, f"payloads not answered with a 4xx:\n{report}\nlog: {log}"
    assert proc.poll() is None, f"mlxd died; log: {log}"
    assert out["health"] == 200
    assert out["unseeded_sampling_after"] == 200
    assert out["running_with_unread_client_open"] == 0
    assert set(out["counted"].values()) <= {200, 429}, out["counted"]
    assert out["attacked"] == out["alone"]
    assert len(out["alone"]) == NORMAL["max_tokens"]


async def _sigterm_while_a_client_reads_nothing(url: str, proc: subprocess.Popen) -> int:
    """SIGTERM while a stream is stuck on a client that reads nothing: the drain cuts it
    off and the process still exits (0) in about drain + flush + send timeouts."""
    opened, close = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_non_reading_client, url, opened, close, 400)
        await opened.wait()
        async with httpx.AsyncClient(base_url=url, timeout=CLIENT_S) as http:
            with trio.fail_after(CLIENT_S):
                while (await _status(http))["engine"]["decoding"] < 8:
                    await trio.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        code = await trio.to_thread.run_sync(lambda: proc.wait(timeout=CLIENT_S))
        close.set()
    return code


def test_sigterm_with_a_stuck_client_still_exits_cleanly(daemon):
    url, proc, log = daemon
    assert trio.run(_sigterm_while_a_client_reads_nothing, url, proc) == 0
    text = log.read_text()
    assert "requests cut off" in text
    assert "Traceback" not in text, f"a traceback in {log}"
