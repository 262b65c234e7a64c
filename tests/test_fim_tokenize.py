"""llama.cpp's ``/tokenize`` and ``/detokenize`` keep off the event loop and within bounds:
``/detokenize`` decodes on a worker thread, at most ``fim.max_detokenize_tokens`` ids;
``parse_special: false`` is honoured or refused, never silently dropped."""

from __future__ import annotations

import threading

from tests.conftest import settings_with
from tests.fakes import CharTokenizer
from tests.test_fim_routes import FimCharTokenizer, client, post


class ThreadNoting(FimCharTokenizer):
    """Notes the thread each decode runs on."""

    def __init__(self) -> None:
        self.decoded_on: list[threading.Thread] = []

    def decode(self, ids, skip_special_tokens=True):
        self.decoded_on.append(threading.current_thread())
        return super().decode(ids, skip_special_tokens)


async def test_detokenize_decodes_on_a_worker_thread():
    tokenizer = ThreadNoting()
    async with client(tokenizer=tokenizer) as (c, _, _):
        tokenizer.decoded_on.clear()  # whatever loading the model decoded
        status, out = await post(c, "/detokenize", {"tokens": [104, 105] * 1000})
    assert status == 200 and out["content"] == "hi" * 1000
    assert tokenizer.decoded_on and threading.main_thread() not in tokenizer.decoded_on


async def test_detokenize_takes_at_most_max_detokenize_tokens():
    settings = settings_with(fim={"max_detokenize_tokens": 100})
    async with client(settings=settings) as (c, _, _):
        ok, _ = await post(c, "/detokenize", {"tokens": [104] * 100})
        status, out = await post(c, "/detokenize", {"tokens": [104] * 101})
    assert ok == 200 and status == 400
    assert out["error"]["type"] == "invalid_request_error"
    assert "fim.max_detokenize_tokens" in out["error"]["message"]


async def test_parse_special_false_is_refused_where_the_tokenizer_cannot_honour_it():
    """A tokenizer whose encode has no ``split_special_tokens``: parse_special false is a
    400 in llama.cpp's format (it used to be dropped, special tokens parsed anyway)."""
    async with client(tokenizer=CharTokenizer()) as (c, _, _):
        status, out = await post(c, "/tokenize", {"content": "ab", "parse_special": False})
        ok, parsed = await post(c, "/tokenize", {"content": "ab"})
    assert status == 400 and out["error"]["code"] == 400
    assert "parse_special" in out["error"]["message"]
    assert ok == 200 and parsed["tokens"] == [97, 98]


async def test_parse_special_false_is_honoured_where_the_tokenizer_can():
    async with client() as (c, _, _):
        _, split = await post(c, "/tokenize", {"content": "a<fim_pad>", "parse_special": False})
    assert split["tokens"] == [ord(ch) for ch in "a<fim_pad>"]
