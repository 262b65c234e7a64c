"""Ollama's API through the official ``ollama`` Python client, unchanged.

Most tests share one real ``mlxd serve`` process on a tiny random-weight model: chat,
generate, streaming, options, ``format``, the model listings, ``keep_alive`` and the
error shapes. The tool-call round trip (and ``thinking``) runs in-process over the real
runner with a scripted answer (``tests/scripted.py``): a random model calls no tools.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import trio
from mlxd.daemon.settings import load_settings

from tests.processes import free_port, wait_healthy
from tests.scripted import Script, recording_server

pytestmark = pytest.mark.mlx

try:
    import ollama
except ImportError:  # in the test extra: a CI run without it is broken
    if os.environ.get("CI") == "true":
        raise
    pytest.skip("the ollama client is not installed (the test extra)", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
MODEL = "tiny"
EMBEDDER = "tiny-embed"
VISION = "tiny-vl"
WAIT_S = 300.0  # a hang, not a slow machine
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture(scope="module")
def url(tmp_path_factory, tiny_models, smollm_tokenizer):
    """``mlxd serve`` with the tiny llama as ``tiny`` (preloaded), a tiny embedding model
    as ``tiny-embed`` and a tiny vision model as ``tiny-vl``; unknown ids are 404s."""
    from mlxd.scripts import tiny_models as tm

    tmp = tmp_path_factory.mktemp("ollama")
    embedder = tm.build_embedding_model(smollm_tokenizer, tmp / "embedder")
    config = tmp / "mlxd.toml"
    config.write_text(
        f'[model]\naccept_other_ids = false\ncache_dir = "{tmp}"\n'
        f'[[models]]\nid = "{MODEL}"\npath = "{tiny_models("llama")}"\npreload = true\n'
        f'[[models]]\nid = "{EMBEDDER}"\npath = "{embedder}"\nkind = "embedding"\n'
        f'[[models]]\nid = "{VISION}"\npath = "{tiny_models("qwen2_vl")}"\n'
    )
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = tmp / "mlxd.log"
    command = [sys.executable, "-m", "mlxd.daemon.cli", "serve"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*command, "--port", str(port), "--config", str(config)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:
        wait_healthy(base, lambda: proc.poll() is None, WAIT_S, log.read_text)
        yield base
    finally:
        if proc.poll() is not None:  # it died during the tests: say why
            print(log.read_text()[-6000:])
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def client(url):
    with ollama.Client(host=url, timeout=WAIT_S) as c:
        yield c


def _user(text: str = "Hello there") -> list[dict]:
    return [{"role": "user", "content": text}]


def _status(exc: pytest.ExceptionInfo) -> int:
    return exc.value.status_code


# ---- chat and generate --------------------------------------------------------------------


def test_chat_answers_with_counts_and_durations(client):
    r = client.chat(model=MODEL, messages=_user(), options=GREEDY)
    assert r.done is True and r.done_reason == "length"
    assert r.message.role == "assistant" and r.message.content
    assert r.eval_count == 6 and r.prompt_eval_count > 0
    assert r.total_duration >= r.eval_duration > 0 and r.load_duration == 0
    assert r.prompt_eval_duration >= 0 and r.model == MODEL


def test_logprobs(client):
    r = client.chat(model=MODEL, messages=_user(), options=GREEDY, logprobs=True, top_logprobs=2)
    assert len(r.logprobs) == 6 and "".join(p.token for p in r.logprobs) == r.message.content
    assert all(len(p.top_logprobs) == 2 and p.logprob <= 0 for p in r.logprobs)
    assert client.chat(model=MODEL, messages=_user(), options=GREEDY).logprobs is None


def test_streaming_chat_is_the_unstreamed_answer_in_pieces(client):
    whole = client.chat(model=MODEL, messages=_user(), options=GREEDY)
    chunks = list(client.chat(model=MODEL, messages=_user(), options=GREEDY, stream=True))
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert chunks[-1].done_reason == "length" and chunks[-1].eval_count == 6
    assert "".join(c.message.content for c in chunks) == whole.message.content


def test_generate_streams_ndjson_and_answers_once_unstreamed(client, url):
    whole = client.generate(model=MODEL, prompt="Once upon a time", options=GREEDY)
    assert whole.done and whole.eval_count == 6 and whole.response
    parts = list(
        client.generate(model=MODEL, prompt="Once upon a time", options=GREEDY, stream=True)
    )
    assert "".join(p.response for p in parts) == whole.response
    # the default is to stream, one JSON object a line
    body = {"model": MODEL, "prompt": "Once upon a time", "options": GREEDY}
    with httpx.stream("POST", f"{url}/api/generate", json=body, timeout=WAIT_S) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1]["done"] is True and len(lines) > 1
    assert "".join(line["response"] for line in lines) == whole.response


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    return buf.getvalue()


def test_images_reach_a_vision_model(client):
    plain = client.chat(model=VISION, messages=_user("What is it?"), options=GREEDY)
    seen = client.chat(
        model=VISION,
        messages=[{"role": "user", "content": "What is it?", "images": [_png()]}],
        options=GREEDY,
        keep_alive=0,  # done with it: room for the others
    )
    assert seen.done and seen.prompt_eval_count > plain.prompt_eval_count  # the image's tokens
    assert "vision" in client.show(VISION).capabilities


def test_raw_generate_skips_the_template(client):
    raw = client.generate(model=MODEL, prompt="Once upon a time", raw=True, options=GREEDY)
    templated = client.generate(model=MODEL, prompt="Once upon a time", options=GREEDY)
    assert raw.prompt_eval_count < templated.prompt_eval_count


def test_sampling_options_are_honoured(client):
    drawn = {"temperature": 1.0, "seed": 7, "num_predict": 8, "top_k": 50, "top_p": 0.9}
    a = client.generate(model=MODEL, prompt="Hi", options=drawn)
    b = client.generate(model=MODEL, prompt="Hi", options=drawn)
    c = client.generate(model=MODEL, prompt="Hi", options={**drawn, "seed": 8})
    assert a.response == b.response != c.response
    long = {**GREEDY, "num_predict": 16}
    plain = client.generate(model=MODEL, prompt="Hi", options=long).response
    penalised = client.generate(model=MODEL, prompt="Hi", options={**long, "repeat_penalty": 3.0})
    off = {**long, "repeat_penalty": 3.0, "repeat_last_n": 0}  # a window of 0: no penalty
    assert (
        penalised.response
        != plain
        == client.generate(model=MODEL, prompt="Hi", options=off).response
    )
    # runtime options change no answer: accepted
    tuned = {**GREEDY, "num_thread": 2, "num_gpu": 1, "use_mmap": False}
    assert client.generate(model=MODEL, prompt="Hi", options=tuned).eval_count == 6
    # a stop string taken from the greedy answer ends it there
    text = client.generate(model=MODEL, prompt="Hi", options={**GREEDY, "num_predict": 12})
    stop = text.response[len(text.response) // 2 :][:3]
    assert stop
    cut = client.generate(
        model=MODEL, prompt="Hi", options={**GREEDY, "num_predict": 12, "stop": [stop]}
    )
    assert cut.done_reason == "stop" and text.response.startswith(cut.response + stop)


def test_num_ctx_bounds_prompt_and_answer(client):
    long = "word " * 60
    with pytest.raises(ollama.ResponseError) as exc:
        client.generate(model=MODEL, prompt=long, options={"num_ctx": 16})
    assert _status(exc) == 400 and "num_ctx" in exc.value.error
    counted = client.generate(model=MODEL, prompt="Hi", options=GREEDY).prompt_eval_count
    fit = client.generate(model=MODEL, prompt="Hi", options={"num_ctx": counted + 2})
    assert fit.eval_count == 2 and fit.done_reason == "length"


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"mirostat": 2}, "mirostat"),
        ({"typical_p": 0.5}, "typical_p"),
        ({"repeat_penalty": 1.3, "repeat_last_n": 64}, "repeat_last_n"),
        ({"temperature": -1}, "temperature"),
        ({"num_predict": 0}, "num_predict"),
    ],
)
def test_options_that_cannot_be_honoured_are_400s(client, options, field):
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model=MODEL, messages=_user(), options=options)
    assert _status(exc) == 400 and field in exc.value.error


def test_format_json_schema_and_json(client, url):
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    r = client.chat(
        model=MODEL, messages=_user("Where?"), format=schema, options={"num_predict": 40}
    )
    assert r.done_reason == "stop"
    assert json.loads(r.message.content)["city"] in ("Paris", "Rome")
    j = client.generate(
        model=MODEL, prompt="JSON please", format="json", options={"num_predict": 5}
    )
    assert j.response.lstrip().startswith("{")
    r = httpx.post(f"{url}/api/generate", json={"model": MODEL, "prompt": "x", "format": "yaml"})
    assert r.status_code == 400 and "format" in r.json()["error"]


# ---- models -------------------------------------------------------------------------------


def test_list_show_ps_version(client, url):
    names = [m.model for m in client.list().models]
    assert names == [MODEL, EMBEDDER, VISION]
    shown = client.show(MODEL)
    assert "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.details.family == "llama"
    running = client.ps().models
    assert [m.model for m in running] == [MODEL] and running[0].context_length > 0
    assert httpx.get(f"{url}/api/version").json()["version"]


def _ps(client) -> dict:
    return {m.model: m for m in client.ps().models}


def _until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_keep_alive_sets_the_pools_idle_unload(client):
    client.chat(model=MODEL, messages=_user(), options=GREEDY, keep_alive="10m")
    expires = _ps(client)[MODEL].expires_at
    now = datetime.now(UTC)
    assert now + timedelta(minutes=9) < expires < now + timedelta(minutes=11)
    client.chat(model=MODEL, messages=_user(), options=GREEDY, keep_alive=-1)
    _until(lambda: _ps(client)[MODEL].expires_at.year > 2200, "keep_alive -1: never")
    # keep_alive 0: unloaded once the answer is done; the next request loads it again
    client.chat(model=MODEL, messages=_user(), options=GREEDY, keep_alive=0)
    _until(lambda: MODEL not in _ps(client), "keep_alive 0 unloads the model")
    again = client.chat(model=MODEL, messages=_user(), options=GREEDY)
    assert again.load_duration > 0 and MODEL in _ps(client)
    # an empty prompt only unloads (keep_alive 0) or loads
    gone = client.generate(model=MODEL, prompt="", keep_alive=0)
    assert gone.done and gone.done_reason == "unload"
    _until(lambda: MODEL not in _ps(client), "an empty prompt with keep_alive 0 unloads")
    loaded = client.generate(model=MODEL, prompt="")
    assert loaded.done_reason == "load" and MODEL in _ps(client)


# ---- embeddings ---------------------------------------------------------------------------


def test_embed_and_the_legacy_embeddings(client):
    r = client.embed(model=EMBEDDER, input=["a cat", "a dog", "a cat"])
    cat, dog, cat_again = (np.array(v) for v in r.embeddings)
    assert r.model == EMBEDDER and r.prompt_eval_count > 0 and len(cat) == len(dog) > 0
    assert float(cat @ cat_again) == pytest.approx(1.0, abs=1e-5)  # normalised, identical
    assert float(cat @ dog) < 0.9999
    (one,) = client.embed(model=EMBEDDER, input="a cat").embeddings
    assert np.allclose(one, cat, atol=1e-5)
    legacy = client.embeddings(model=EMBEDDER, prompt="a cat").embedding
    assert np.allclose(legacy, cat, atol=1e-5)
    assert client.show(EMBEDDER).capabilities == ["embedding"]
    assert client.embed(model=EMBEDDER, input=[]).embeddings == []  # only loads it
    with pytest.raises(ollama.ResponseError) as exc:
        client.embed(model=EMBEDDER, input="a cat", dimensions=len(cat) + 1)
    assert _status(exc) == 400 and "dimensions" in exc.value.error


def test_a_chat_model_does_not_embed_nor_an_embedding_model_chat(client):
    with pytest.raises(ollama.ResponseError) as exc:
        client.embed(model=MODEL, input="a cat")
    assert _status(exc) == 400 and "embeddings" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model=EMBEDDER, messages=_user())
    assert _status(exc) == 400 and "embedding model" in exc.value.error


# ---- errors -------------------------------------------------------------------------------


def test_errors_in_ollamas_shape(client, url):
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model="no-such-model", messages=_user())
    assert _status(exc) == 404 and "no-such-model" in exc.value.error
    r = httpx.post(f"{url}/api/chat", json={"model": MODEL, "messages": [{"role": "x"}]})
    assert r.status_code == 400 and set(r.json()) == {"error"}
    r = httpx.post(f"{url}/api/generate", json={"prompt": "hi"})
    assert r.status_code == 400 and "model is required" in r.json()["error"]
    r = httpx.post(f"{url}/api/chat", json={"model": MODEL, "messages": 3})
    assert r.status_code == 400 and "messages" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as exc:  # a text model refuses images
        client.generate(model=MODEL, prompt="What is it?", images=[b"\x89PNG\r\n\x1a\n"])
    assert _status(exc) == 400 and "image" in exc.value.error
    with pytest.raises(ollama.ResponseError) as exc:
        client.chat(model=MODEL, messages=_user(), keep_alive="soon")
    assert _status(exc) == 400 and "keep_alive" in exc.value.error
    for field, value in (("suffix", "end"), ("context", [1, 2]), ("template", "{{ .Prompt }}")):
        r = httpx.post(f"{url}/api/generate", json={"model": MODEL, "prompt": "a", field: value})
        assert r.status_code == 400 and field in r.json()["error"]
    r = httpx.post(f"{url}/api/chat", json={"model": MODEL, "messages": _user(), "think": "lots"})
    assert r.status_code == 400 and "think" in r.json()["error"]
    with pytest.raises(ollama.ResponseError) as exc:
        client.pull(MODEL)
    assert _status(exc) == 404 and "pull" in exc.value.error
    assert client.chat(model=MODEL, messages=_user(), options=GREEDY).done  # still serving


# ---- tools and thinking (scripted through the real runner) ---------------------------------


@pytest.fixture(scope="module")
def scripted_settings(tmp_path_factory, tiny_models):
    base = msgspec.to_builtins(load_settings())
    base["model"]["path"] = str(tiny_models("llama"))
    base["model"]["served_id"] = MODEL
    base["model"]["cache_dir"] = str(tmp_path_factory.mktemp("mlxd-cache"))
    base["tokenizer"]["reasoning_tags"] = "<think>,</think>"
    return msgspec.convert(base, type=type(load_settings()))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def _tool_round_trip(url: str) -> None:
    client = ollama.Client(host=url, timeout=WAIT_S)
    messages = _user("Weather in Paris?")
    r = client.chat(model=MODEL, messages=messages, tools=[WEATHER])
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert r.done_reason == "stop"
    streamed = list(client.chat(model=MODEL, messages=messages, tools=[WEATHER], stream=True))
    calls = [c for chunk in streamed for c in chunk.message.tool_calls or ()]
    assert [c.function.arguments for c in calls] == [{"city": "Paris"}]
    messages += [r.message, {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    final = client.chat(model=MODEL, messages=messages, tools=[WEATHER], think=True)
    assert final.message.content == "Done." and final.message.thinking == "Sunny, say so."
    assert not final.message.tool_calls


async def test_tool_call_round_trip_and_thinking(scripted_settings):
    script = Script({"get_weather": {"city": "Paris"}}, final="<think>Sunny, say so.</think>Done.")
    async with recording_server(scripted_settings, script) as served:
        await trio.to_thread.run_sync(_tool_round_trip, served.url)
    last = served.recorder.posts("/api/chat")[-1]
    assert "sunny" in last.request.decode()
    assert served.runner.started[-1].reply.endswith("Done.")


# ---- the pool's keep_alive (no server) ----------------------------------------------------


def test_pool_keep_alive_replaces_idle_unload_per_model():
    from mlxd.actors.engine.scheduler.core import EngineCore
    from mlxd.actors.engine.scheduler.pool import ModelPool, ModelSpec, PoolLimits

    from tests.fakes import FakeRunner
    from tests.test_models_multi import FakeModel

    now = [0.0]
    specs = [ModelSpec(m, FakeModel(runner=FakeRunner()), 0, preload=True) for m in "ab"]
    pool = ModelPool.of(
        specs,
        PoolLimits(max_loaded=2, idle_unload_s=100.0),
        lambda runner, info, n: EngineCore(runner, max_batch=4, prefill_chunk_tokens=64),
        clock=lambda: now[0],
    )
    pool.preload()
    pool.set_keep_alive("a", 10.0)
    assert pool.next_expiry() == 10.0 and pool.ttl("b") == 100.0
    assert time.time() + 9 < pool.stats()["a"].expires_at < time.time() + 11
    now[0] = 10.0
    pool.expire()
    assert list(pool.loaded) == ["b"]  # a's keep_alive ran out, b's idle_unload_s has not
    pool.set_keep_alive("b", math.inf)  # -1: never
    now[0] = 1e6
    pool.expire()
    assert list(pool.loaded) == ["b"] and pool.stats()["b"].expires_at == 0.0
    pool.set_keep_alive("b", None)  # back to idle_unload_s, counted from now
    assert pool.next_expiry() == 1e6 + 100.0
    pool.set_keep_alive("b", 0.0)
    pool.expire()
    assert not pool.loaded
