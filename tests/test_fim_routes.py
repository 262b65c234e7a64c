"""Fill-in-the-middle through the whole daemon over a scripted fake runner: llama.cpp's
``/infill`` (and ``/tokenize``, ``/detokenize``), OpenAI's ``suffix`` and Ollama's
``suffix``, whole and streamed, with their refusals, llama.cpp's typing stops and a newer
request superseding an older one.

The fake model wears a character tokenizer with StarCoder2's FIM tokens (at private-use
code points) and answers a FIM prompt with its suffix in brackets, then an end token
(``<file_sep>``) and text that must never be shown.
"""

from __future__ import annotations

import json
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio
from mlxd.actors.engine.scheduler.types import ModelInfo
from mlxd.daemon.api import infill
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings

from tests.conftest import real_server, running_graph, wait_until
from tests.fakes import EOS, CharTokenizer, FakeRunner

SPECIAL = {
    "<|endoftext|>": EOS,
    "<fim_prefix>": 0xE000,
    "<fim_suffix>": 0xE001,
    "<fim_middle>": 0xE002,
    "<file_sep>": 0xE003,
    "<repo_name>": 0xE004,
    "<fim_pad>": 0xE005,
}
NAMES = {i: n for n, i in SPECIAL.items()}
PRE, SUF, MID, SEP, REPO = (chr(SPECIAL[n]) for n in list(SPECIAL)[1:6])


class FimCharTokenizer(CharTokenizer):
    """One token per character; StarCoder2's FIM tokens are single special ids."""

    def get_vocab(self) -> dict[str, int]:
        return dict(SPECIAL)

    def encode(self, text, add_special_tokens=True, split_special_tokens=False):
        if not split_special_tokens:
            for name, i in SPECIAL.items():
                text = text.replace(name, chr(i))
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(
            ("" if skip_special_tokens else NAMES[i]) if i in NAMES else chr(i) for i in ids
        )


def answer(prompt: str) -> str:
    """The fake model's middle for a FIM prompt."""
    suffix = prompt.partition(SUF)[2].partition(MID)[0]
    if "LONG" in suffix:
        return "x" * 100_000
    if "LINES" in suffix:
        return "a = 1\n    b = 2\n  c = 3\nd = 4\n" * 20
    return f"[{suffix.strip()}]\nmore" + SEP + "NEVER"


class FimRunner(FakeRunner):
    """Answers FIM prompts with ``answer``; records every prompt it is given."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.prompts: list[str] = []

    def start(self, request):
        prompt = "".join(chr(t) for t in request.prompt_tokens)
        self.prompts.append(prompt)
        if PRE in prompt and request.request_id not in self.replies:
            reply = [ord(c) for c in answer(prompt)] + [EOS]
            self.replies[request.request_id] = (request.prompt_tokens, reply)
        return super().start(request)


def factory(runner, tokenizer):
    def make():
        info = ModelInfo(
            model_id="fake-coder",
            model_dir=Path("."),
            context_length=8192,
            vocab_size=0x110000,
            tokenizer=tokenizer,
            backend="fake",
        )
        return runner, info

    return make


@asynccontextmanager
async def client(tokenizer=None, runner=None, settings=None):
    settings = settings or load_settings()
    runner = runner or FimRunner()
    make = factory(runner, tokenizer or FimCharTokenizer())
    async with running_graph(settings, factory=make) as (pipeline, runner):
        yield create_app(pipeline, settings).test_client(), pipeline, runner


@asynccontextmanager
async def server(runner=None):
    """The app behind hypercorn (the test client's channel holds only 10 body chunks:
    streams are read over a real socket)."""
    runner = runner or FimRunner()
    make = factory(runner, FimCharTokenizer())
    async with real_server(factory=make) as (url, _, runner):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            yield http, runner


async def post(c, path, body):
    r = await c.post(path, json=body)
    return r.status_code, json.loads(await r.get_data())


async def stream(http, path, body):
    r = await http.post(path, json=body)
    assert r.status_code == 200
    raw = r.text
    if path == "/api/generate":
        return [json.loads(line) for line in raw.splitlines() if line]
    frames = [f.removeprefix("data: ") for f in raw.split("\n\n") if f]
    return [json.loads(f) for f in frames if f != "[DONE]"]


INFILL = {"input_prefix": "def f():\n    return ", "input_suffix": "  # done\n", "temperature": 0}


# ---- the layout reaches the model ----------------------------------------------------------


async def test_infill_lays_out_the_repository_and_answers_the_middle():
    extra = [{"filename": "a.py", "text": "A = 1"}, {"filename": "b.py", "text": "B = 2\n"}]
    body = {**INFILL, "input_extra": extra, "prompt": "x + "}
    async with client() as (c, _, runner):
        status, out = await post(c, "/infill", body)
    assert status == 200
    (prompt,) = runner.prompts
    # StarCoder2: <repo_name>NAME, <file_sep>PATH\nTEXT per file, then <file_sep><fim_prefix>
    # with the edited file's path opening the prefix, <fim_suffix>, <fim_middle>, prompt
    assert prompt == (
        f"{REPO}project{SEP}a.py\nA = 1\n{SEP}b.py\nB = 2\n{SEP}{PRE}filename\n"
        f"def f():\n    return {SUF}  # done\n{MID}x + "
    )
    assert out["content"] == "[# done]\nmore"  # cut at <file_sep>: never "NEVER"
    assert out["stop"] is True and out["stop_type"] == "eos"
    assert out["tokens_evaluated"] == len(prompt) and out["tokens_predicted"] > 0
    assert out["timings"]["predicted_n"] == out["tokens_predicted"]


async def test_a_fim_token_spelled_in_the_code_stays_text():
    body = {**INFILL, "input_prefix": "s = '<fim_middle>'\n"}
    async with client() as (c, _, runner):
        status, _ = await post(c, "/infill", body)
    assert status == 200
    assert runner.prompts[0].startswith(PRE + "s = '<fim_middle>'\n" + SUF)


async def test_infill_streams_llama_cpp_chunks():
    async with server() as (http, _):
        chunks = await stream(http, "/infill", {**INFILL, "stream": True})
    assert all(not ch["stop"] for ch in chunks[:-1])
    assert "".join(ch["content"] for ch in chunks) == "[# done]\nmore"
    last = chunks[-1]
    assert last["stop"] is True and last["stop_type"] == "eos"
    assert last["timings"]["predicted_n"] > 0
    # the chunks before the last carry no counts yet, and no nulls in their place
    assert all(set(ch) == {"content", "stop", "index", "id_slot", "tokens"} for ch in chunks[:-1])


async def test_prompt_time_does_not_count_the_models_load():
    """After an unload, the next /infill waits for the load: llama.cpp's ``prompt_ms`` is
    the prompt's processing, so the load's second is not in it."""
    import time

    runner = FimRunner()
    make = factory(runner, FimCharTokenizer())
    loads: list[int] = []

    def slow_reload():
        loads.append(1)
        if len(loads) > 1:
            time.sleep(1.0)
        return make()

    settings = load_settings()
    async with running_graph(settings, factory=slow_reload) as (pipeline, _):
        c = create_app(pipeline, settings).test_client()
        model = pipeline.models.default
        r = await c.post(f"/v1/models/{model}/unload", json={})
        assert r.status_code == 200, await r.get_data()
        sent = time.perf_counter()
        status, out = await post(c, "/infill", INFILL)
        wall_ms = (time.perf_counter() - sent) * 1e3
    assert status == 200 and len(loads) == 2
    # the load's second came before the engine took the prompt: whatever the box's speed,
    # prompt time is at most the rest of the request's time
    assert out["timings"]["prompt_ms"] <= wall_ms - 1000, (out["timings"], wall_ms)


async def test_response_fields_picks_and_unnests():
    body = {**INFILL, "response_fields": ["content", "timings/prompt_n", "nothing"]}
    async with client() as (c, _, _):
        _, out = await post(c, "/infill", body)
    assert set(out) == {"content", "prompt_n"}


async def test_openai_suffix_is_insertion_whole_and_streamed():
    body = {"prompt": "x = ", "suffix": " + 1\n", "temperature": 0}
    async with client() as (c, _, runner):
        status, whole = await post(c, "/v1/completions", body)
    async with server() as (http, _):
        chunks = await stream(http, "/v1/completions", {**body, "stream": True})
    assert status == 200
    assert runner.prompts[0] == f"{PRE}x = {SUF} + 1\n{MID}"
    assert whole["choices"][0]["text"] == "[+ 1]\nmore"
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    streamed = "".join(ch["choices"][0]["text"] for ch in chunks if ch["choices"])
    assert streamed == "[+ 1]\nmore"


async def test_ollama_suffix_is_fill_in_the_middle_whole_and_streamed():
    body = {"model": "fake-coder", "prompt": "y = ", "suffix": "\nz", "stream": False}
    async with client() as (c, _, runner):
        status, whole = await post(c, "/api/generate", {**body, "options": {"temperature": 0}})
    async with server() as (http, _):
        lines = await stream(http, "/api/generate", {**body, "stream": True})
    assert status == 200
    assert runner.prompts[0] == f"{PRE}y = {SUF}\nz{MID}"
    assert whole["response"] == "[z]\nmore" and whole["done"] is True
    assert "".join(line["response"] for line in lines) == "[z]\nmore"
    assert lines[-1]["done"] is True


# ---- refusals, each in its API's own error format ----------------------------------------------


async def test_a_model_without_fim_tokens_refuses_each_way_in():
    async with client(tokenizer=CharTokenizer()) as (c, _, _):
        s1, oa = await post(c, "/v1/completions", {"prompt": "a", "suffix": "b"})
        s2, ol = await post(
            c, "/api/generate", {"model": "fake-coder", "prompt": "a", "suffix": "b"}
        )
        s3, ll = await post(c, "/infill", INFILL)
    assert (s1, s2, s3) == (400, 400, 400)
    assert oa["error"]["param"] == "suffix" and "fill in the middle" in oa["error"]["message"]
    assert "suffix" in ol["error"] and "fill in the middle" in ol["error"]
    assert ll["error"]["code"] == 400 and ll["error"]["type"] == "invalid_request_error"
    assert "fill in the middle" in ll["error"]["message"]


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ("notes.txt", "input_extra"),
        ([{"filename": "a.py"}], "text"),
        ([{"filename": 3, "text": "x"}], "filename"),
        ([["a.py", "x"]], "input_extra"),
    ],
)
async def test_input_extra_must_be_a_list_of_filename_and_text(extra, field):
    async with client() as (c, _, runner):
        status, out = await post(c, "/infill", {**INFILL, "input_extra": extra})
    assert status == 400 and field in out["error"]["message"]
    assert set(out["error"]) == {"code", "message", "type"}
    assert runner.prompts == []


async def test_too_many_extra_files_is_a_400():
    extra = [{"filename": f"{i}.py", "text": ""} for i in range(65)]
    async with client() as (c, _, _):
        status, out = await post(c, "/infill", {**INFILL, "input_extra": extra})
    assert status == 400 and "fim.max_extra_files" in out["error"]["message"]


async def test_suffix_with_echo_or_token_ids_is_refused():
    async with client() as (c, _, runner):
        s1, echo = await post(c, "/v1/completions", {"prompt": "a", "suffix": "b", "echo": True})
        s2, ids = await post(c, "/v1/completions", {"prompt": [1, 2], "suffix": "b"})
        s3, two = await post(c, "/v1/completions", {"prompt": "a", "suffix": "b", "n": 2})
    assert (s1, echo["error"]["param"]) == (400, "echo")
    assert (s2, ids["error"]["param"]) == (400, "prompt")
    assert s3 == 200 and [ch["text"] for ch in two["choices"]] == ["[b]\nmore"] * 2
    assert len(runner.prompts) == 2  # only the n = 2 request ran


async def test_ollama_suffix_refuses_what_a_fim_prompt_cannot_carry():
    body = {"model": "fake-coder", "prompt": "a", "suffix": "b"}
    async with client() as (c, _, runner):
        status, out = await post(c, "/api/generate", {**body, "system": "be brief"})
    assert status == 400 and "system" in out["error"]
    assert runner.prompts == []


# ---- typing stops ---------------------------------------------------------------------------


async def test_n_indent_ends_the_middle_at_a_dedented_line():
    body = {**INFILL, "input_suffix": "LINES", "n_indent": 4}
    async with client() as (c, _, _):
        _, whole = await post(c, "/infill", body)
    async with server() as (http, _):
        chunks = await stream(http, "/infill", {**body, "stream": True})
    assert whole["content"] == "a = 1\n    b = 2\n"
    assert whole["stop_type"] == "limit"
    assert "".join(ch["content"] for ch in chunks) == whole["content"]


async def test_t_max_predict_ms_ends_at_the_first_new_line_after_the_limit(monkeypatch):
    clock = {"now": 0.0}

    def now() -> float:  # each reading a second later: the limit passes while it decodes
        clock["now"] += 1.0
        return clock["now"]

    monkeypatch.setattr(infill, "_now", now)
    body = {**INFILL, "input_suffix": "LINES", "t_max_predict_ms": 3000, "n_predict": 400}
    async with client() as (c, _, _):
        _, out = await post(c, "/infill", body)
    full = ("a = 1\n    b = 2\n  c = 3\nd = 4\n" * 20)[:400]
    assert out["stop_type"] == "limit"
    assert out["content"].endswith("\n") and full.startswith(out["content"])
    assert len(out["content"]) < len(full)


def test_typing_stop_holds_indentation_until_the_line_decides():
    stop = infill.TypingStop(n_indent=4)
    assert stop.feed("if x:\n", 0.0) == "if x:\n"
    assert stop.feed("      ", 0.0) == ""  # indentation alone: held
    assert stop.feed("go()\n  ", 0.0) == "      go()\n"
    assert stop.feed("back()", 0.0) == "" and stop.stopped


def test_typing_stop_time_limit_needs_a_new_line():
    stop = infill.TypingStop(t_max_s=1.0)
    assert stop.feed("abc", 0.0) == "abc" and not stop.stopped
    assert stop.feed("def", 5.0) == "def" and not stop.stopped  # no new line yet
    assert stop.feed("\n", 5.5) == "\n" and stop.stopped


# ---- a newer request supersedes the older one ------------------------------------------------


async def test_a_newer_request_on_the_same_file_ends_the_older_at_once():
    body = {**INFILL, "input_suffix": "LONG\n", "n_predict": 5000}
    async with client(runner=FimRunner(step_delay=0.01)) as (c, pipeline, runner):
        results = {}

        async def older():
            results["older"] = await post(c, "/infill", body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(older)
            await wait_until(lambda: runner.running)  # the older one is decoding
            (older_id,) = runner.running
            typed = {**body, "input_prefix": body["input_prefix"] + "x", "n_predict": 3}
            results["newer"] = await post(c, "/infill", typed)
        assert older_id in runner.removed  # its row was aborted
    status, old = results["older"]
    assert status == 200 and old["stop_type"] == "abort"
    assert len(old["content"]) < 5000  # what it had when the newer one came
    assert results["newer"][1]["stop_type"] == "limit"  # its own 3 tokens


async def test_another_file_does_not_supersede():
    body = {**INFILL, "input_suffix": "x\nLINES", "n_predict": 50}
    other = {**body, "input_prefix": "class Other:\n    pass\n"}
    async with client() as (c, _, _):
        async with trio.open_nursery() as nursery:
            outs = []

            async def one(b):
                outs.append(await post(c, "/infill", b))

            nursery.start_soon(one, body)
            nursery.start_soon(one, other)
    assert [o[1]["stop_type"] for o in outs] == ["limit", "limit"]


@pytest.mark.parametrize("streamed", [True, False])
async def test_a_client_that_hangs_up_cancels_its_row(streamed):
    body = {**INFILL, "input_suffix": "LONG\n", "n_predict": 5000, "stream": streamed}
    async with server(FimRunner(step_delay=0.01)) as (http, runner):
        if streamed:
            async with http.stream("POST", "/infill", json=body) as r:
                async for line in r.aiter_lines():
                    if '"content":"x' in line:
                        break  # hang up after the first token
        else:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(http.post, "/infill", json=body))
                await wait_until(lambda: runner.running)  # decoding
                nursery.cancel_scope.cancel()  # the client hangs up
        await wait_until(lambda: not runner.running and not runner.prefilling)
        assert len(runner.removed) == 1  # aborted, not decoded to its 5000 tokens
        assert runner.decode_steps < 5000


async def test_status_shows_the_fim_format_and_why():
    async with client() as (c, _, _):
        await post(c, "/infill", INFILL)  # the model's prompt builder exists from here on
        r = await c.get("/v1/status")
        fim = json.loads(await r.get_data())["model"]["fim"]
    assert fim["format"] == "starcoder2" and "<fim_prefix>" in fim["why"]
    async with client(tokenizer=CharTokenizer()) as (c, _, _):
        await post(c, "/infill", INFILL)
        r = await c.get("/v1/status")
        fim = json.loads(await r.get_data())["model"]["fim"]
    assert fim["format"] is None and "no fill-in-the-middle tokens" in fim["why"]


# ---- /tokenize and /detokenize ---------------------------------------------------------------


async def test_tokenize_and_detokenize():
    async with client() as (c, _, _):
        _, plain = await post(c, "/tokenize", {"content": "a<fim_pad>"})
        _, split = await post(c, "/tokenize", {"content": "a<fim_pad>", "parse_special": False})
        _, pieces = await post(c, "/tokenize", {"content": "ab", "with_pieces": True})
        _, text = await post(c, "/detokenize", {"tokens": [104, 0xE005, 105]})
        status, bad = await post(c, "/detokenize", {"tokens": [-1]})
    assert plain["tokens"] == [97, 0xE005]
    assert split["tokens"] == [ord(ch) for ch in "a<fim_pad>"]
    assert pieces["tokens"] == [{"id": 97, "piece": "a"}, {"id": 98, "piece": "b"}]
    assert text["content"] == "h<fim_pad>i"
    assert status == 400 and bad["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("tokenizer", "insert"), [(None, True), (CharTokenizer, False)])
async def test_ollama_show_says_insert_where_the_model_fills_in_the_middle(tokenizer, insert):
    """Ollama's ``insert`` capability (what its clients check before sending ``suffix``):
    a model with FIM tokens has it, one without does not."""
    async with client(tokenizer=tokenizer() if tokenizer else None) as (c, pipeline, _):
        status, shown = await post(c, "/api/show", {"model": pipeline.models.default})
    assert status == 200, shown
    assert ("insert" in shown["capabilities"]) is insert
    assert shown["capabilities"][:2] == ["completion", "tools"]
