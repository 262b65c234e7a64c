"""Embeddings: the engine's batching of embedding inputs (a scripted runner), the pooling
head on a tiny random model, and ``/v1/embeddings`` through a real ``mlxd serve`` whose
``[[models]]`` mix a chat model and an embedding model."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from mlxd.actors.engine.scheduler.embedding import EmbeddingCore
from mlxd.actors.engine.scheduler.options import EmbeddingOptions
from mlxd.protocol.messages import EmbedRequest, RunnerCounters, TokenizedRequest

from tests.conftest import chat as chat_request
from tests.conftest import metric
from tests.processes import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 300.0  # a hang, not a slow machine
TEXTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog.",
    "MLX runs on the CPU backend here, and an embedding model pools its hidden states.",
    "a b",
    "Embeddings turn text into vectors; similar texts get similar vectors, in theory at least.",
    "x",
]


# ---- the engine's batching (no MLX) ------------------------------------------------------


class ScriptedRunner:
    """Embeds a token list as [len, sum, first]; records each pass; fails on token 666
    (an allocation failure on 999)."""

    def __init__(self):
        self.passes: list[list[tuple[int, ...]]] = []

    def embed(self, batch):
        self.passes.append(list(batch))
        if any(666 in ids for ids in batch):
            raise ValueError("token 666")
        if any(999 in ids for ids in batch):
            raise RuntimeError("[metal::malloc] Unable to allocate")
        return np.array([[len(t), sum(t), t[0]] for t in batch], dtype=np.float32)

    def clear_cache(self):
        pass

    def release_buffers(self):
        pass

    def memory_stats(self):
        return 0, 0

    def counters(self):
        return RunnerCounters()


def request(rid, *inputs):
    return EmbedRequest(request_id=rid, model="e", inputs=tuple(tuple(i) for i in inputs))


def run_all(core):
    steps = []
    while not core.idle:
        steps.append(core.step())
    return steps


def test_core_batches_oldest_inputs_within_both_caps():
    runner = ScriptedRunner()
    options = EmbeddingOptions(max_batch_inputs=3, max_batch_tokens=12)
    core = EmbeddingCore(runner, options)
    core.submit(request("a", [1, 2], [3]))
    core.submit(request("b", [4, 5, 6, 7], [8], [9, 9]))
    core.submit(request("c", list(range(1, 20))))  # longer than max_batch_tokens: alone
    steps = run_all(core)
    assert [len(p) for p in runner.passes] == [3, 2, 1]  # "c" with 2 others: 3 x 19 > 12
    assert runner.passes[0] == [(1, 2), (3,), (4, 5, 6, 7)]  # 3 inputs x 4 tokens = 12
    assert [[r.request_id for r in s.started] for s in steps] == [["a", "b"], [], ["c"]]
    done = {e.request_id: e for s in steps for e in s.embedded}
    assert done["a"].vectors.tolist() == [[2, 3, 1], [1, 3, 3]]
    assert done["b"].prompt_tokens == 7 and done["c"].prompt_tokens == 19
    assert core.idle and core.stats().waiting == 0


def test_core_request_spans_passes_and_abort_drops_it():
    runner = ScriptedRunner()
    core = EmbeddingCore(runner, EmbeddingOptions(max_batch_inputs=2))
    core.submit(request("a", [1], [2], [3], [4], [5]))
    core.submit(request("b", [6]))
    first = core.step()
    assert not first.embedded and [s.request_id for s in first.started] == ["a"]
    core.abort("a")
    steps = run_all(core)
    assert runner.passes[-1] == [(6,)]
    assert [e.request_id for s in steps for e in s.embedded] == ["b"]


def test_core_queue_limit_refuses_with_429():
    core = EmbeddingCore(ScriptedRunner(), EmbeddingOptions(max_queued_inputs=3))
    core.submit(request("a", [1], [2]))
    core.submit(request("b", [3], [4]))  # 2 queued + 2 > 3
    step = core.step()
    assert [(f.request_id, f.reason) for f in step.failed] == [("b", "queue_full")]
    assert step.failed[0].retry_after
    # an empty queue takes any request the per-request limit let through
    run_all(core)
    core.submit(request("c", [1], [2], [3], [4]))
    assert [e.request_id for s in run_all(core) for e in s.embedded] == ["c"]


def test_core_failed_pass_fails_only_the_culprit():
    runner = ScriptedRunner()
    core = EmbeddingCore(runner, EmbeddingOptions())
    core.submit(request("good", [1, 2]))
    core.submit(request("bad", [666]))
    core.submit(request("later", [3]))
    steps = run_all(core)
    assert [(f.request_id, f.reason) for s in steps for f in s.failed] == [
        ("bad", "internal_error")
    ]
    assert sorted(e.request_id for s in steps for e in s.embedded) == ["good", "later"]
    assert sum(len(s.started) for s in steps) == 3  # one Started each, retries included


def test_core_allocation_failure_fails_the_pass_with_503s():
    core = EmbeddingCore(ScriptedRunner(), EmbeddingOptions())
    core.submit(request("a", [999]))
    core.submit(request("b", [1]))
    failed = [f for s in run_all(core) for f in s.failed]
    assert {(f.request_id, f.reason) for f in failed} == {
        ("a", "out_of_memory"),
        ("b", "out_of_memory"),
    }


def test_core_refuses_a_generation_request():
    core = EmbeddingCore(ScriptedRunner(), EmbeddingOptions())
    tokenized = TokenizedRequest(
        request_id="g", prompt_tokens=(1,), sampling=chat_request("g", "x").sampling
    )
    core.submit(tokenized)
    assert [f.reason for f in core.step().failed] == ["invalid_request"]
    assert core.idle


# ---- the pooling head (MLX, this thread) ----------------------------------------------------


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory, smollm_tokenizer):
    from mlxd.scripts import tiny_models as tm

    return tm.build_embedding_model(smollm_tokenizer, tmp_path_factory.mktemp("embed") / "m")


@pytest.mark.mlx
def test_pooling_ignores_padding():
    import mlx.core as mx
    from mlxd.actors.engine.runner.embedding import pool

    hidden = mx.array(np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2))
    lengths = mx.array([3, 1])
    assert np.array(pool(hidden, lengths, "mean")).tolist() == [[2, 3], [6, 7]]
    assert np.array(pool(hidden, lengths, "last")).tolist() == [[4, 5], [6, 7]]
    assert np.array(pool(hidden, lengths, "cls")).tolist() == [[0, 1], [6, 7]]


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    from mlxd.scripts import tiny_models as tm

    return tm.build_bert_embedding_model(tmp_path_factory.mktemp("bert") / "m")


@pytest.mark.mlx
@pytest.mark.parametrize(
    ("model", "pooling"),
    [("qwen3", "mean"), ("qwen3", "last"), ("qwen3", "cls"), ("bert", "cls"), ("bert", "mean")],
)
def test_runner_batch_equals_alone(request, model, pooling):
    """A decoder (mlx-lm, causal) and an encoder (mlx-embeddings, masked attention)."""
    from mlxd.actors.engine.loading.load import load_runner

    path = request.getfixturevalue("embedding_dir" if model == "qwen3" else "bert_dir")
    options = EmbeddingOptions(pooling=pooling)
    runner, info = load_runner(
        str(path), path, dequantize_on_cpu=True, max_batch=8, kind="embedding", embedding=options
    )
    e = info.embedding
    assert info.kind == "embedding" and e.pooling == pooling
    if model == "qwen3":
        assert (e.backend, e.dimensions, e.matryoshka) == ("mlx-lm", 64, (16, 32))
    else:
        assert (e.backend, e.dimensions, e.matryoshka) == ("mlx-embeddings", 32, ())
    batch = [tuple(info.tokenizer.encode(t)) for t in TEXTS]
    together = runner.embed(batch)
    alone = np.concatenate([runner.embed([ids]) for ids in batch])
    assert together.shape == (len(TEXTS), e.dimensions)
    np.testing.assert_allclose(together, alone, atol=2e-5)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    assert not np.allclose(together[0], together[1])  # the inputs are told apart


# ---- /v1/embeddings through `mlxd serve` ------------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, embedding_dir, bert_dir, tiny_models):
    """``mlxd serve`` with a chat model and two embedding models (module-wide)."""
    tmp = tmp_path_factory.mktemp("serve")
    config = tmp / "mlxd.toml"
    config.write_text(
        f'[model]\ncache_dir = "{tmp}"\n'
        "[embeddings]\nmax_inputs = 8\nmax_input_tokens = 40\nmax_batch_inputs = 4\n"
        "[model_pool]\nmax_loaded = 3\n"
        f'[[models]]\nid = "chat"\npath = "{tiny_models("llama")}"\n'
        f'[[models]]\nid = "embed"\npath = "{embedding_dir}"\nkind = "embedding"\n'
        f'[[models]]\nid = "bert"\npath = "{bert_dir}"\nkind = "embedding"\npreload = true\n'
    )
    port, log = free_port(), tmp / "mlxd.log"
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--port", str(port)]
            + ["--config", str(config)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:
        wait_healthy(url, lambda: proc.poll() is None, WAIT_S, log.read_text)
        with httpx.Client(base_url=url, timeout=WAIT_S) as http:
            yield http
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        proc.kill()
        proc.wait()
    assert "Traceback" not in log.read_text()


def embed(http, input, model="embed", **extra):
    r = http.post("/v1/embeddings", json={"model": model, "input": input, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def vectors(body):
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def refused(http, body, param=None, status=400, model="embed"):
    r = http.post("/v1/embeddings", json={"model": model, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["type"] == ("invalid_request_error" if status == 400 else error["type"])
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def assert_idle(http):
    status = http.get("/v1/status").json()
    assert not status["requests"]["running"] and not status["requests"]["waiting"]
    engine = status["engine"]
    assert engine["waiting"] == engine["prefilling"] == engine["decoding"] == 0


@pytest.mark.mlx
def test_api_batch_equals_alone_and_identical_texts(served):
    texts = [*TEXTS, TEXTS[1]]  # 7 inputs: two passes of at most 4, mixed lengths
    body = embed(served, texts)
    assert body["object"] == "list" and body["model"] == "embed"
    assert [d["index"] for d in body["data"]] == list(range(len(texts)))
    assert all(d["object"] == "embedding" for d in body["data"])
    together = vectors(body)
    alone = np.concatenate([vectors(embed(served, t)) for t in texts])
    np.testing.assert_allclose(together, alone, atol=2e-5)
    assert together.shape == (len(texts), 64)
    assert float(together[1] @ together[-1]) == pytest.approx(1.0, abs=1e-5)  # cosine
    assert float(together[0] @ together[2]) < 0.999
    encoded = vectors(embed(served, texts, model="bert"))  # an encoder, masked padding
    assert encoded.shape == (len(texts), 32)
    alone = np.concatenate([vectors(embed(served, t, model="bert")) for t in texts[:3]])
    np.testing.assert_allclose(encoded[:3], alone, atol=2e-5)
    usage = body["usage"]
    assert (
        usage["prompt_tokens"]
        == usage["total_tokens"]
        == sum(embed(served, t)["usage"]["prompt_tokens"] for t in texts)
    )
    assert_idle(served)


@pytest.mark.mlx
def test_api_input_forms_agree(served, embedding_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(embedding_dir / "tokenizer.json"))
    ids = [tokenizer.encode(t).ids for t in TEXTS[:3]]
    one = embed(served, TEXTS[0])
    assert len(one["data"]) == 1 and one["usage"]["prompt_tokens"] == len(ids[0])
    texts = vectors(embed(served, TEXTS[:3]))
    np.testing.assert_allclose(vectors(one)[0], texts[0], atol=2e-5)
    np.testing.assert_allclose(vectors(embed(served, ids[1]))[0], texts[1], atol=2e-5)
    by_ids = embed(served, ids, user="someone")  # user: accepted, no effect
    np.testing.assert_allclose(vectors(by_ids), texts, atol=2e-5)
    assert by_ids["usage"]["prompt_tokens"] == sum(map(len, ids))


@pytest.mark.mlx
def test_api_base64_and_dimensions(served):
    full = vectors(embed(served, TEXTS[:2]))
    packed = embed(served, TEXTS[:2], encoding_format="base64")
    decoded = np.stack(
        [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in packed["data"]]
    )
    np.testing.assert_array_equal(decoded, full)
    from openai import OpenAI  # the SDK asks for base64 and decodes it itself

    client = OpenAI(base_url=f"{served.base_url}/v1", api_key="unused", max_retries=0)
    sdk = client.embeddings.create(model="embed", input=TEXTS[:2])
    np.testing.assert_allclose(np.array([d.embedding for d in sdk.data]), full, atol=1e-6)
    assert sdk.usage.prompt_tokens == packed["usage"]["prompt_tokens"]
    cut = vectors(embed(served, TEXTS[:2], dimensions=16))
    assert cut.shape == (2, 16)
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(cut, expected, atol=1e-5)
    np.testing.assert_allclose(vectors(embed(served, TEXTS[0], dimensions=64)), full[:1], atol=2e-5)
    for bad in (20, 63, 65, 128):
        assert "16, 32, 64" in refused(served, {"input": "x", "dimensions": bad}, "dimensions")
    refused(served, {"input": "x", "dimensions": 0}, "dimensions")
    refused(served, {"input": "x", "encoding_format": "hex"}, "encoding_format")


@pytest.mark.mlx
def test_api_refusals(served):
    refused(served, {"input": ""}, "input[0]")
    refused(served, {"input": []}, "input")
    refused(served, {"input": [[]]}, "input[0]")
    refused(served, {"input": ["a", 1]}, "input")
    refused(served, {"input": [[1, "a"]]}, "input")
    refused(served, {"input": [True, False]}, "input")
    refused(served, {"input": {"text": "a"}})
    assert "embeddings.max_inputs" in refused(served, {"input": ["a"] * 9}, "input")
    long = " ".join(["word"] * 60)
    assert "at most 40" in refused(served, {"input": ["ok", long]}, "input[1]")
    assert "[0, 49152)" in refused(served, {"input": [1, 49152]}, "input[0]")
    refused(served, {"input": [[5], [-1]]}, "input[1]")
    message = refused(served, {"input": "x"}, "model", model="chat")  # a chat model
    assert "does not serve embeddings" in message
    refused(served, {"input": "x"}, "model", status=404, model="nope")
    r = served.post(
        "/v1/chat/completions",
        json={"model": "embed", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "model"
    r = served.post("/v1/completions", json={"model": "embed", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400, r.text
    # the daemon serves on: chat on the chat model, embeddings on the embedding model
    r = served.post(
        "/v1/chat/completions",
        json={"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )
    assert r.status_code == 200, r.text
    assert len(embed(served, "still here")["data"]) == 1
    assert_idle(served)
    # a refusal once the request had a session (the input was too long) counts as a 400
    metrics = served.get("/metrics").text
    assert metric(metrics, "mlxd_requests_total", 'model="embed",status="400"') >= 1
    assert 'model="embed",status="499"' not in metrics  # never as a client that left
