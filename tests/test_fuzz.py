"""Fuzzing every POST route with hostile requests (issue 11): nothing a client sends may
crash the daemon or harm another request.

Requests come from ``tests/strategies.py``, derived from the wire structs in
``protocol/`` (a new field is fuzzed without touching this file), a third each
plausible, with extreme numbers and token ids, and hostile (wrong types, deep
nesting, odd unicode, invalid UTF-8, missing and unknown fields, odd
Content-Type and Host headers); a fifth of the clients hang up after the first
bytes. Fixed corner cases (``CORNER_FIELDS``, ``http_corner_cases``,
``output_corner_cases``) run first, every time. Requests go over a real socket
to the app behind hypercorn from a worker thread, one or a burst of up to three
at a time (Hypothesis drives them, so a failure is shrunk to a minimal request
and reported per kind, named after the server's exception), while a canary
task keeps sending a well-formed request.

Every example must get a status below 500 within ``hang_s``, a streamed 200
no malformed frame or server error, a JSON answer valid JSON, and the server
must log no exception for it (one a client that hung up would never see). At most three
requests are in flight beside the canary, so the server is never legitimately
overloaded: a 503 counts as a failure like any 5xx (a 429 would pass, being a
client-side answer, but cannot occur here). After the run the engine is idle,
``/health`` answers 200, the canary never failed, and the process's RSS grew
less than a bound.

Tiers: the scripted fake runner (``FAKE_EXAMPLES`` per route, its own server
each; ``BURST_EXAMPLES`` bursts over all routes; ``OUTPUT_EXAMPLES`` per
tool-call format, where the fake echoes hostile tool-call and reasoning markup
for the output parsers), and the real default model (``REAL_EXAMPLES`` bursts
over all routes, ``mlx`` marker; answers capped at 32 tokens to fit a CPU):
MLX does no bounds checks of its own, so an unchecked token id can crash it,
and the real tokenizer refuses what the fake's accepts. Run with ``-s`` to see
each run's summary line (requests, statuses, failures, the commonest 400s).
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import httpx
import pytest
import trio
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st
from mlxd.protocol import anthropic, openai, responses

from tests import strategies as fz
from tests.conftest import real_server, settings_with
from tests.fakes import FakeRunner, fake_factory

ROUTES = {
    "/v1/chat/completions": openai.ChatCompletionRequest,
    "/v1/completions": openai.CompletionRequest,
    "/v1/messages": anthropic.MessagesRequest,
    "/v1/messages/count_tokens": anthropic.CountTokensRequest,
    "/v1/responses": responses.ResponsesRequest,
}
# Generated examples per run, after the fixed corner cases (derandomized: the same ones
# every run). Sized so the whole suite stays within CI's time on a 2-core machine.
FAKE_EXAMPLES = {
    "/v1/chat/completions": 40,
    "/v1/completions": 30,
    "/v1/messages": 30,
    "/v1/messages/count_tokens": 15,
    "/v1/responses": 30,
}
REAL_EXAMPLES = 8  # bursts of up to three requests
OUTPUT_EXAMPLES = 5  # per tool-call format
BURST_EXAMPLES = 15  # of up to three requests at once
JSON = "application/json"
# In-stream error types that mean the server failed (OpenAI's, Anthropic's).
SERVER_ERROR_TYPES = {"server_error", "api_error", "overloaded_error", "service_unavailable"}


def _kib_rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@dataclass(frozen=True)
class Probe:
    """One hostile request."""

    path: str
    body: bytes
    content_type: str | None
    host: str | None
    hang_up: bool = False  # the client closes the connection after the first bytes

    def headers(self) -> dict[str, bytes]:
        """As bytes: httpx would refuse a non-ASCII value, a server may not."""
        headers = {"Content-Type": self.content_type, "Host": self.host}
        return {k: v.encode() for k, v in headers.items() if v is not None}

    def __repr__(self) -> str:
        body = self.body if len(self.body) <= 300 else self.body[:300] + b"..."
        return (
            f"Probe({self.path!r}, body={body!r} ({len(self.body)} bytes), "
            f"content_type={self.content_type!r}, host={self.host!r}, hang_up={self.hang_up})"
        )

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis's report uses this
        printer.text(repr(self))


class ServerErrors(logging.Handler):
    """Exceptions the server logged (quart logs each 500 with its traceback)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.seen.append(_where(record.exc_info[1]))


def _where(exc: BaseException) -> str:
    """``Type at file:function``: the innermost frame in mlxd's code, else the innermost one."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "site-packages" not in f.filename] or frames
    at = f" at {Path(ours[-1].filename).name}:{ours[-1].name}" if ours else ""
    return f"{type(exc).__name__}{at}"


@cache
def failure(kind: str) -> type[AssertionError]:
    """One exception type per kind of failure, so Hypothesis shrinks and reports each."""
    return type(f"Fuzz[{kind}]", (AssertionError,), {})


@st.composite
def probes(draw, paths: list[str]) -> Probe:
    """A third each: plausible requests, extreme numbers, hostile anything (``fz.Derive``)."""
    path = draw(st.sampled_from(paths))
    mode = draw(st.sampled_from(fz.MODES))
    value = draw(fz.request_body(ROUTES[path], mode))
    hang_up = draw(st.sampled_from([False] * 4 + [True]))
    if mode != "hostile":
        body = fz.to_json(value, ascii_only=draw(st.booleans())).encode()
        return Probe(path, body, "application/json", None, hang_up)
    body = draw(fz.http_body(value))
    return Probe(path, body, draw(fz.content_type()), draw(fz.host()), hang_up)


# A minimal valid body per route, for the fixed corner cases below.
BASE = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
}


def _called(arguments: str) -> dict:
    """An assistant turn that called ``f`` with ``arguments`` (JSON text, as the API has it)."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


def _function_call(arguments: str) -> dict:
    return {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments}


_answered = {"role": "tool", "tool_call_id": "c1", "content": "12C"}
_function_output = {"type": "function_call_output", "call_id": "c1", "output": "12C"}
# Fields set on top of a base body: each once crashed, or would crash, a server like this
# one (MLX checks no bounds). Fields a route lacks are unknown there, hence ignored.
CORNER_FIELDS = [
    {"logit_bias": {"10000000": 5}},
    {"logit_bias": {"-1": 1, "49152": 1}},
    {"logit_bias": {"0": fz.RawNumber("1e400")}},
    {"prompt": [10**7]},
    {"prompt": [-1, 2**63]},
    {"seed": 2**64},
    {"seed": -(10**30)},
    {"top_k": 10**12},
    {"max_tokens": 10**30},
    {"n": 10**9},
    {"temperature": fz.RawNumber("NaN")},
    {"top_p": 1e-320},
    {"messages": [{"role": "user", "content": "a\x00\ud800b"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
    {"input": [{"type": "function_call_output", "call_id": "x", "output": fz.nested(60)}]},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"$ref": "#"}}}},
    {"messages": [{"role": "user", "content": "x" * 300_000}]},  # longer than the context
    {"messages": [_called(r'{"q": "\ud800"}'), _answered, {"role": "user", "content": "hi"}]},
    {"messages": [_called('{"q": ' + "[" * 5000 + "]" * 5000 + "}"), _answered]},
    {"input": [_function_call(r'{"q": "\udfff"}'), _function_output]},
    {"prompt": "x" * 300_000, "input": "x" * 300_000},
]


def corner_cases(path: str) -> list[Probe]:
    """Fixed probes for ``path``, run before the generated ones (Hypothesis's explicit phase):
    a valid body with one extreme field."""
    base = BASE[path]
    return [
        Probe(path, fz.to_json(base | extra, True).encode(), JSON, None) for extra in CORNER_FIELDS
    ]


def http_corner_cases(path: str) -> list[Probe]:
    """Fixed probes for ``path``: broken bytes, headers and bodies around a valid request."""
    ok = fz.to_json(BASE[path], True).encode()
    probes = [
        Probe(path, ok, JSON, "a" * 300),  # an IDNA label over 63 characters
        Probe(path, ok, JSON, "évil.example"),
        Probe(path, ok, "text/plain", None),
        Probe(path, ok, None, None),
        Probe(path, fz.Deep(100_000).json().encode(), JSON, None),
        Probe(path, b'{"x": "' + b"x" * (5 << 20) + b'"}', JSON, None),  # over max_body_bytes
        Probe(path, ok.replace(b"hi", b"h\xff\xfei"), JSON, None),
        Probe(path, ok.replace(b"hi", b"\xed\xa0\x80"), JSON, None),  # a UTF-8 encoded surrogate
    ]
    return probes + [Probe(path, body, JSON, None) for body in (b"", b"null", b"[]", b"{", b"\x00")]


def alone(probes: st.SearchStrategy[Probe]) -> st.SearchStrategy[tuple[Probe, ...]]:
    return probes.map(lambda p: (p,))


def bursts(paths: list[str]) -> st.SearchStrategy[tuple[Probe, ...]]:
    """Up to three probes sent at once: they may share a tokenizer worker and a batch."""
    return st.lists(probes(paths), min_size=1, max_size=3).map(tuple)


def _reason(body: bytes) -> str:
    """A 400's gist: the start of its message (Anthropic's starts with the param)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return "?"
    param = f"{error['param']}: " if error.get("param") else ""
    return param + str(error.get("message", "?"))[:32]


def _is_json(body: bytes) -> bool:
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


def stream_error(body: bytes) -> str | None:
    """The first malformed frame or server-side error event in an SSE body, if any."""
    for line in body.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            event = json.loads(line.removeprefix(b"data: "))
        except ValueError:
            return f"malformed SSE frame: {line[:300]!r}"
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict) and error.get("type") in SERVER_ERROR_TYPES:
            return f"in-stream error: {error}"
    return None


@dataclass
class Fuzzer:
    """Sends probes (a burst at a time) and judges each answer; keeps the tally."""

    url: str
    hang_s: float
    errors: ServerErrors = field(default_factory=ServerErrors)
    tried: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: Counter = field(default_factory=Counter)
    rejected: Counter = field(default_factory=Counter)  # 400s by reason, for the summary
    slowest: float = 0.0

    def check(self, probes: tuple[Probe, ...]) -> None:
        """Send the probes at once; raise ``failure(kind)`` unless every answer is acceptable."""
        self.tried += len(probes)
        logged = len(self.errors.seen)
        with ThreadPoolExecutor(len(probes)) as pool:
            problems = [p for p in pool.map(self._problem, probes) if p is not None]
        logged_now = self.errors.seen[logged:]
        if logged_now and not problems:  # e.g. after the client hung up: it saw nothing
            problems = [f"the server logged {logged_now}"]
        if not problems:
            return
        kind = ", ".join(dict.fromkeys(self.errors.seen[logged:])) or problems[0].split(":")[0]
        self.failures[kind] += 1
        raise failure(kind)("; ".join(problems))

    def _problem(self, probe: Probe) -> str | None:
        """None when the answer is acceptable, else what is wrong with it."""
        started = time.monotonic()
        try:
            with httpx.Client(base_url=self.url, timeout=self.hang_s) as http:
                headers = probe.headers()
                with http.stream("POST", probe.path, content=probe.body, headers=headers) as r:
                    body = next(r.iter_raw(), b"") if probe.hang_up else r.read()
        except httpx.TimeoutException:
            self.statuses["timeout"] += 1
            return f"no answer within {self.hang_s} s"
        except httpx.TransportError as exc:
            self.statuses["transport"] += 1
            return f"connection failed: {exc!r}"
        elapsed = time.monotonic() - started
        self.slowest = max(self.slowest, elapsed)
        self.statuses[r.status_code] += 1
        if elapsed > self.hang_s:
            return f"answered after {elapsed:.1f} s"
        if r.status_code == 400:
            self.rejected[_reason(body)] += 1
        if r.status_code >= 500:
            return f"HTTP {r.status_code}: {body[:300]!r}"
        if probe.hang_up:
            return None
        content_type = r.headers.get("content-type", "")
        if content_type.startswith("text/event-stream"):
            return stream_error(body)
        if content_type.startswith("application/json") and not _is_json(body):
            return f"malformed JSON answer: {body[:300]!r}"
        return None


@dataclass
class Canary:
    """A well-formed request sent again and again during the run; every answer is checked."""

    url: str
    body: dict
    expect: str | None  # the exact message content, or None: any 200
    sent: int = 0
    errors: list[str] = field(default_factory=list)

    async def run(self, stop: trio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            while not stop.is_set():
                r = await http.post("/v1/chat/completions", json=self.body)
                self.sent += 1
                if r.status_code != 200:
                    self.errors.append(f"canary HTTP {r.status_code}: {r.text[:300]}")
                else:
                    content = r.json()["choices"][0]["message"]["content"]
                    if self.expect is not None and content != self.expect:
                        self.errors.append(f"canary got {content!r}")
                await trio.sleep(0.2)  # leave the (shared, small) CPU to the probes


@dataclass(frozen=True)
class Tier:
    """One fuzz run: which routes, how many generated examples, which fixed ones first."""

    name: str
    paths: list[str]
    examples: int
    corners: list[Probe]
    hang_s: float
    fake: bool  # the fake runner fails prompts with FAIL / OOM on purpose: not sent
    mb_bound: float  # RSS growth allowed over the run, once idle
    settle_s: float = 0.0  # then: prefix cache cleared, the engine idle this long (real model)


def fuzz(fuzzer: Fuzzer, canary: Canary, tier: Tier, strategy: st.SearchStrategy) -> None:
    """Run Hypothesis over the tier's routes in this (worker) thread."""

    @settings(
        max_examples=tier.examples,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(probes=strategy)
    def prop(probes: tuple[Probe, ...]) -> None:
        bodies = b"".join(p.body for p in probes)
        assume(not tier.fake or (b"FAIL" not in bodies and b"OOM" not in bodies))
        canary_errors = len(canary.errors)
        fuzzer.check(probes)
        if len(canary.errors) > canary_errors:
            raise failure("canary")(canary.errors[canary_errors:])

    for case in tier.corners:
        prop = example(probes=(case,))(prop)
    logger = logging.getLogger()
    logger.addHandler(fuzzer.errors)
    try:
        prop()
    finally:
        logger.removeHandler(fuzzer.errors)


async def run_tier(url: str, tier: Tier, canary: Canary, strategy: st.SearchStrategy) -> None:
    """Fuzz while the canary runs; then the server must still be healthy, its RSS bounded."""
    fuzzer = Fuzzer(url, hang_s=tier.hang_s)
    rss_before, started = _kib_rss(), time.monotonic()
    stop = trio.Event()

    async def fuzz_then_stop():
        try:
            await trio.to_thread.run_sync(fuzz, fuzzer, canary, tier, strategy)
        finally:
            stop.set()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(canary.run, stop)
            nursery.start_soon(fuzz_then_stop)
    finally:
        growth_mb = (_kib_rss() - rss_before) / 1024
        print(
            f"\nfuzz {tier.name}: {len(tier.corners)} fixed + up to {tier.examples} generated "
            f"examples, {fuzzer.tried} requests (shrinking included) in "
            f"{time.monotonic() - started:.1f} s, "
            f"statuses {dict(sorted(fuzzer.statuses.items(), key=str))}, "
            f"slowest {fuzzer.slowest:.2f} s, canary {canary.sent} sent "
            f"{len(canary.errors)} failed, RSS {growth_mb:+.0f} MB at the end, "
            f"failures {dict(fuzzer.failures) or 'none'}; "
            f"400s mostly {dict(fuzzer.rejected.most_common(6))}"
        )
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        health = await http.get("/health")
        if tier.settle_s:  # what is still held once MLX gave its freed buffers back
            await http.delete("/v1/cache")
            await trio.sleep(tier.settle_s)
            growth_mb = (_kib_rss() - rss_before) / 1024
            print(f"fuzz {tier.name}: RSS {growth_mb:+.0f} MB once idle, prefix cache cleared")
    assert health.status_code == 200, health.text
    assert not canary.errors
    assert growth_mb < tier.mb_bound


@pytest.mark.slow  # hundreds of generated requests
@pytest.mark.parametrize("path", list(ROUTES))
async def test_fuzz_fake_runner(path):
    corners = corner_cases(path) + http_corner_cases(path)
    tier = Tier(f"fake {path}", [path], FAKE_EXAMPLES[path], corners, 20.0, True, 300)
    async with real_server() as (url, _, _):
        body = {"messages": [{"role": "user", "content": "!" + "canary " * 10}], "temperature": 0}
        await run_tier(url, tier, Canary(url, body, expect="canary " * 10), alone(probes([path])))
    # leaving real_server asserted the engine idle: nothing held, nothing running


@pytest.mark.slow  # hundreds of generated requests
async def test_fuzz_fake_runner_bursts():
    """Probes for every route, up to three at once."""
    tier = Tier("fake bursts, all routes", list(ROUTES), BURST_EXAMPLES, [], 20.0, True, 300)
    async with real_server() as (url, _, _):
        body = {"messages": [{"role": "user", "content": "!" + "canary " * 10}], "temperature": 0}
        await run_tier(url, tier, Canary(url, body, expect="canary " * 10), bursts(tier.paths))


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = {
    "/v1/chat/completions": [
        {"type": "function", "function": {"name": n, "parameters": WEATHER}}
        for n in ("get_weather", "f")
    ],
    "/v1/messages": [{"name": n, "input_schema": WEATHER} for n in ("get_weather", "f")],
    "/v1/responses": [
        {"type": "function", "name": n, "parameters": WEATHER} for n in ("get_weather", "f")
    ],
}


def said(path: str, text: str, stream: bool, **extra) -> bytes:
    """A body, tools offered, whose answer is ``text`` (the fake echoes what follows ``!``)."""
    body: dict = {"tools": TOOLS[path], "stream": stream, "max_tokens": 3000, **extra}
    if path == "/v1/responses":
        body |= {"input": "!" + text, "max_output_tokens": 3000}
    else:
        body["messages"] = [{"role": "user", "content": "!" + text}]
    return fz.to_json(body, True).encode()


@st.composite
def output_probes(draw) -> Probe:
    """A request, with tools offered, whose answer is hostile markup."""
    path = draw(st.sampled_from(list(TOOLS)))
    extra = {}
    if path == "/v1/chat/completions":
        extra = {"n": draw(st.integers(1, 2)), "logprobs": draw(st.booleans())}
        extra["parallel_tool_calls"] = draw(st.booleans())
    body = said(path, draw(fz.model_output()), draw(st.booleans()), **extra)
    return Probe(path, body, JSON, None, draw(st.sampled_from([False] * 4 + [True])))


MARKUP = {
    "hermes": ["<tool_call>{}</tool_call>"],
    "mistral": ["[TOOL_CALLS]{}", "[TOOL_CALLS]f[ARGS]{}"],
    "llama3": ["<|python_tag|>{}", "{}"],
    "json": ["{}"],
}


def output_corner_cases(tool_format: str) -> list[Probe]:
    """Each of ``fz.RAW_CALLS`` in each of the format's markups, streamed or not; of the
    deep ones (a thousand tokens each, slow here) one per format, in its first markup."""
    path, markups = "/v1/chat/completions", MARKUP[tool_format]
    short = [raw for raw in fz.RAW_CALLS if len(raw) < 1000]
    deep = [raw for raw in fz.RAW_CALLS if len(raw) >= 1000]
    texts = [markups[0].replace("{}", deep[list(MARKUP).index(tool_format) % len(deep)], 1)]
    texts += [m.replace("{}", raw, 1) for m in markups for raw in short]
    return [Probe(path, said(path, t, i % 2 == 1), JSON, None) for i, t in enumerate(texts)]


@pytest.mark.slow  # hundreds of generated requests
@pytest.mark.parametrize("tool_format", list(MARKUP))
async def test_fuzz_fake_output_parsers(tool_format):
    """What the model says is the client's to choose (prompt injection; here, the fake's
    echo): tool-call and reasoning markup, whole, broken or nested, must not crash the
    streamer's parsers."""
    settings = settings_with(
        tokenizer={"tool_format": tool_format, "reasoning_tags": "<think>,</think>"}
    )
    corners = output_corner_cases(tool_format)
    name = f"fake output {tool_format}"
    tier = Tier(name, list(TOOLS), OUTPUT_EXAMPLES, corners, 20.0, True, 300)
    # answers run to thousands of tokens: short steps, room in the context
    factory = fake_factory(FakeRunner(step_delay=0.0002), context_length=16384)
    async with real_server(settings, factory) as (url, _, _):
        body = {"messages": [{"role": "user", "content": "!" + "canary " * 10}], "temperature": 0}
        await run_tier(url, tier, Canary(url, body, expect="canary " * 10), alone(output_probes()))


@pytest.fixture(scope="module")
def real_settings(tmp_path_factory):
    """Defaults, but short answers: the real model runs on a shared CPU here."""
    return settings_with(
        model={"cache_dir": str(tmp_path_factory.mktemp("mlxd-cache"))},
        engine={"default_max_tokens": 16, "max_tokens_cap": 32},
    )


@pytest.mark.mlx
async def test_fuzz_real_model(real_settings):
    """All routes; the fixed cases where a bad value could reach MLX or the real tokenizer
    (the HTTP-level ones are the same code as in the fake tier)."""
    from mlxd.daemon.supervisor import mlx_runner_factory

    paths = ["/v1/chat/completions", "/v1/completions", "/v1/responses"]
    corners = [case for path in paths for case in corner_cases(path)]
    settle = real_settings.memory.release_after_idle_s + 1
    tier = Tier("real, all routes", list(ROUTES), REAL_EXAMPLES, corners, 90.0, False, 500, settle)
    async with real_server(real_settings, mlx_runner_factory(real_settings)) as (url, _, _):
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 8,
        }
        await run_tier(url, tier, Canary(url, body, expect=None), bursts(tier.paths))
