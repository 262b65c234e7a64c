"""A newer editor request supersedes the older one (``daemon/api/supersede.py``) on each
FIM route: ``/infill``, ``/v1/completions`` with ``suffix`` and Ollama's ``/api/generate``
with ``suffix``. The key is the whole text outside the line being typed; the older one
ends only once the newer has started; one superseded while it waits ends in its route's
own format."""

from __future__ import annotations

import json
import threading

import pytest
import trio
from mlxd.daemon.api.supersede import Superseder, file_key
from mlxd.daemon.settings import load_settings

from tests.conftest import settings_with, wait_until
from tests.test_fim_routes import INFILL, FimCharTokenizer, FimRunner, client, post

# ---- the key and the sync core --------------------------------------------------------------


def test_the_file_key_is_the_whole_text_outside_the_line_being_typed():
    assert file_key("a\nb\nde", "f\ng\n") == file_key("a\nb\ndef(", "fg\ng\n")  # typing
    assert file_key("a\nb\nde", "f\ng\n") != file_key("x\nb\nde", "f\ng\n")
    head, tail = "H" * 300 + "\n", "\n" + "T" * 300
    one = file_key(head + "class A:\n    x", "y" + "\nline a" + tail)
    two = file_key(head + "class B:\n    x", "y" + "\nline b" + tail)
    assert one != two  # same first and last 300 characters, two files


def test_only_a_started_request_supersedes_and_only_older_ones():
    superseder = Superseder()
    old, new, newest = (superseder.enter("k") for _ in range(3))
    other = superseder.enter("other file")
    assert not any(t.superseded for t in (old, new, newest, other))  # arrivals cancel nothing
    superseder.started(new)
    assert old.superseded and not newest.superseded and not other.superseded
    superseder.started(old)  # it started after a newer one had: it ends itself
    assert not new.superseded
    superseder.leave(newest)  # refused (queue_full): it never started
    assert not new.superseded and len(superseder) == 3


# ---- through the routes -----------------------------------------------------------------------


ROUTES = {
    "/infill": lambda prefix, suffix: {
        **INFILL,
        "input_prefix": prefix,
        "input_suffix": suffix,
    },
    "/v1/completions": lambda prefix, suffix: {
        "prompt": prefix,
        "suffix": suffix,
        "temperature": 0,
    },
    "/api/generate": lambda prefix, suffix: {
        "model": "fake-coder",
        "prompt": prefix,
        "suffix": suffix,
        "stream": False,
        "options": {"temperature": 0},
    },
}


def _limit(route: str, body: dict, n: int) -> dict:
    if route == "/infill":
        return {**body, "n_predict": n}
    if route == "/v1/completions":
        return {**body, "max_tokens": n}
    return {**body, "options": {**body["options"], "num_predict": n}}


def _ended_by(route: str, out: dict) -> str:
    """How the answer says it ended: abort (superseded), or another reason."""
    if route == "/infill":
        return out["stop_type"]
    if route == "/v1/completions":
        return out["choices"][0]["finish_reason"]
    return out["done_reason"]


async def _older_and_newer(c, runner, route, older, newer) -> tuple[dict, tuple[int, dict]]:
    """The older request decoding, then the newer one sent; both answers."""
    results: dict = {}

    async def send_older():
        results["older"] = await post(c, route, older)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_older)
        await wait_until(lambda: runner.running)  # the older one is decoding
        newer_result = await post(c, route, newer)
    return results["older"], newer_result


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_newer_request_on_the_same_file_ends_the_older_on_every_route(route):
    make = ROUTES[route]
    older = _limit(route, make("def f():\n    return ", "LONG\n"), 5000)
    newer = _limit(route, make("def f():\n    return x", "LONG\n"), 3)
    async with client(runner=FimRunner(step_delay=0.01)) as (c, _, runner):
        (status, old), (new_status, _) = await _older_and_newer(c, runner, route, older, newer)
        assert len(runner.removed) >= 1  # the older row was aborted
    assert status == 200 and new_status == 200
    if route == "/api/generate":  # Ollama's done_reason is stop or length
        assert old["done_reason"] == "stop" and len(old["response"]) < 5000
    else:
        assert _ended_by(route, old) == "abort"


async def test_two_files_with_the_same_head_and_tail_do_not_supersede():
    """The reproduction from issue 42: two files whose first and last 300 characters are
    equal, a request for each: neither is cut."""
    head, tail = "H" * 300 + "\n", "\nLONG\n" + "T" * 300
    older = {**INFILL, "input_prefix": head + "a = 1\n", "input_suffix": tail, "n_predict": 40}
    newer = {**INFILL, "input_prefix": head + "b = 2\n", "input_suffix": tail, "n_predict": 3}
    async with client(runner=FimRunner(step_delay=0.01)) as (c, _, runner):
        (_, old), (_, new) = await _older_and_newer(c, runner, "/infill", older, newer)
    assert old["stop_type"] == "limit" and old["tokens_predicted"] == 40
    assert new["stop_type"] == "limit"


async def test_a_newer_request_that_is_refused_does_not_end_the_older():
    settings = settings_with(admission={"max_running": 1, "max_waiting": 0})
    body = {**INFILL, "input_suffix": "LONG\n", "n_predict": 40}
    typed = {**body, "input_prefix": body["input_prefix"] + "x", "n_predict": 3}
    async with client(runner=FimRunner(step_delay=0.01), settings=settings) as (c, _, runner):
        (_, old), (status, refused) = await _older_and_newer(c, runner, "/infill", body, typed)
    assert status == 429 and "admission.max_waiting" in refused["error"]["message"]
    assert old["stop_type"] == "limit" and old["tokens_predicted"] == 40  # not aborted


class GatedTokenizer(FimCharTokenizer):
    """Holds the tokenizing of any text with ``SLOW`` in it until ``gate`` is set."""

    def __init__(self) -> None:
        self.gate, self.held = threading.Event(), threading.Event()

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        if "SLOW" in text:
            self.held.set()
            self.gate.wait(30)
        return super().encode(text, add_special_tokens, split_special_tokens)


def _stream_ends_superseded(route: str, response, raw: bytes) -> None:
    """A stream in the route's own format, ended as a superseded request."""
    if route == "/api/generate":
        assert response.content_type.startswith("application/x-ndjson")
        (last,) = [json.loads(line) for line in raw.splitlines() if line]
        assert last["done"] is True and last["response"] == ""
        return
    assert response.content_type.startswith("text/event-stream")
    frames = [f.removeprefix("data: ") for f in raw.decode().split("\n\n") if f]
    if route == "/v1/completions":
        assert frames[-1] == "[DONE]"
        frames = frames[:-1]
    last = json.loads(frames[-1])
    if route == "/infill":
        assert last["stop"] is True and last["stop_type"] == "abort" and last["content"] == ""
    else:
        assert last["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize("route", list(ROUTES))
async def test_a_stream_superseded_while_it_waits_ends_in_its_own_format(route):
    """The older request is still being tokenized (held) when a newer one on the same line
    of the same file starts: the older ends at once, as a stream of its route's kind."""
    make = ROUTES[route]
    older = {**make("def f():\n    SLOW", "\nrest\n"), "stream": True}
    newer = _limit(route, make("def f():\n    x", "\nrest\n"), 3)
    tokenizer = GatedTokenizer()
    async with client(tokenizer=tokenizer, settings=load_settings()) as (c, _, _):
        got: dict = {}

        async def send_older():
            response = await c.post(route, json=older)
            got["older"] = (response, await response.get_data())

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_older)
                await wait_until(tokenizer.held.is_set)  # the older one waits in the tokenizer
                status, _ = await post(c, route, newer)
                await wait_until(lambda: "older" in got)
        finally:
            tokenizer.gate.set()
    assert status == 200
    response, raw = got["older"]
    assert response.status_code == 200
    _stream_ends_superseded(route, response, raw)
