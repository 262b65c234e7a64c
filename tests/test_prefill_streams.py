"""Prefill chunks split across MLX streams (``MlxRunner.use_prefill_streams``): a chunk runs
as consecutive pieces, each on its own stream, evaluated together so they run side by side.
The pieces share one cache, so the result must be exactly the result of prefilling the same
pieces one after the other on one stream, for attention, recurrent (GatedDeltaNet) and
sliding-window layers alike; and the engine's greedy answers must not change."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlxd.actors.engine.kernels.openblas import OpenBlas
from mlxd.actors.engine.loading.load import auto_prefill_streams, load_runner
from mlxd.actors.engine.runner.base import pieces
from mlxd.actors.engine.scheduler.core import EngineCore

from tests.engine_driver import request, until_idle

pytestmark = pytest.mark.mlx

MODELS = ["smollm", "qwen3_5", "baichuan_m1"]


def test_pieces_are_consecutive_and_not_too_short():
    assert pieces(100, 2) == [(0, 100)]  # two pieces would be under 64 tokens each
    assert pieces(128, 2) == [(0, 64), (64, 128)]
    assert pieces(513, 2) == [(0, 256), (256, 513)]
    assert pieces(300, 1) == [(0, 300)]
    assert pieces(200, 4) == [(0, 66), (66, 133), (133, 200)]
    assert pieces(0, 2) == [(0, 0)]


def test_auto_is_two_streams_on_the_cpu_backend():
    assert auto_prefill_streams() == (1 if mx.default_device() == mx.gpu else 2)


def load(path, streams):
    runner, _ = load_runner(
        str(path), path, dequantize_on_cpu=True, max_batch=4, prefill_streams=streams
    )
    return runner


def record_calls(runner):
    """Wrap the runner's model: record each call's token count and the stream it ran on."""
    calls = []
    model = runner.model

    def recorded(inputs, *args, **kwargs):
        calls.append((inputs.shape[1], mx.default_stream(mx.default_device())))
        return model(inputs, *args, **kwargs)

    runner.model = recorded
    return calls


def model_path(name, smollm_tokenizer, tiny_models):
    return smollm_tokenizer if name == "smollm" else tiny_models(name)


PROMPT = tuple(300 + (t * 37) % 4000 for t in range(302))


@pytest.mark.parametrize("name", MODELS)
def test_a_chunk_runs_as_pieces_on_two_streams_and_equals_them_run_in_turn(
    name, smollm_tokenizer, tiny_models
):
    path = model_path(name, smollm_tokenizer, tiny_models)
    split = load(path, 2)
    calls = record_calls(split)
    split.start(request("r", PROMPT, max_tokens=4))
    assert split.prefill("r", 300) == 1  # 301 to prefill: one token left, still pending
    assert [n for n, _ in calls] == [150, 150]
    assert calls[0][1] != calls[1][1]  # two streams

    in_turn = load(path, 1)
    calls = record_calls(in_turn)
    in_turn.start(request("r", PROMPT, max_tokens=4))
    # The split chunk ran with OpenBLAS lowered to cores / 2 threads; OpenBLAS's sums are
    # not bitwise the same at every thread count on every CPU, so the reference runs with
    # the same count.
    blas = OpenBlas.loaded()
    same_threads = blas.at_most(max(1, blas.threads // 2)) if blas else contextlib.nullcontext()
    with same_threads:
        assert in_turn.prefill("r", 150) == 151
        assert in_turn.prefill("r", 150) == 1
    assert [n for n, _ in calls] == [150, 150] and calls[0][1] == calls[1][1]

    a = tree_flatten([c.state for c in split._pending["r"].cache])
    b = tree_flatten([c.state for c in in_turn._pending["r"].cache])
    assert [k for k, _ in a] == [k for k, _ in b] and a
    for (_, x), (_, y) in zip(a, b, strict=True):
        if isinstance(x, mx.array):
            assert x.shape == y.shape
            assert mx.array_equal(x, y).item()  # bitwise: the same pieces, the same order
        else:
            assert x == y


@pytest.mark.parametrize("name", MODELS)
def test_engine_answers_do_not_change_with_prefill_streams(name, smollm_tokenizer, tiny_models):
    path = model_path(name, smollm_tokenizer, tiny_models)
    prompts = {
        "long": PROMPT,
        "short": tuple(range(700, 760)),
        "mid": tuple(1500 + (t * 11) % 900 for t in range(190)),
    }

    def answers(streams, chunk):
        core = EngineCore(
            load(path, streams), max_batch=4, prefill_chunk_tokens=chunk, batch_prefill=False
        )
        for rid, prompt in prompts.items():
            core.submit(request(rid, prompt, max_tokens=6))
        return until_idle(core)

    # a 256-token budget on two streams runs 128-token pieces: the same boundaries as a
    # 128-token budget on one stream, so the answers must be identical
    assert answers(2, 256) == answers(1, 128)


@pytest.mark.skipif(OpenBlas.loaded() is None, reason="OpenBLAS is not loaded")
def test_openblas_gets_fewer_threads_while_a_split_chunk_runs(smollm_tokenizer):
    lib = OpenBlas.loaded()
    before = lib.threads
    lib.set_threads(2)
    try:
        runner = load(smollm_tokenizer, 2)
        seen = []
        model = runner.model

        def recorded(inputs, *args, **kwargs):
            seen.append((inputs.shape[1], lib.threads))
            return model(inputs, *args, **kwargs)

        runner.model = recorded
        runner.start(request("r", PROMPT, max_tokens=4))
        runner.prefill("r", 100)  # one piece: OpenBLAS keeps its threads
        assert lib.threads == 2
        runner.prefill("r", 200)  # two pieces: one thread while they run
        assert seen == [(100, 2), (100, 1), (100, 1)]
        assert lib.threads == 2  # and its two back after
    finally:
        lib.set_threads(before)
