"""The chunked gated delta rule (``actors/engine/kernels/linear_attention.py``) against mlx-lm's own
token-by-token recurrence: the same outputs and final state within float32 rounding, for
any length (partial last chunk included), a carried-in state, grouped heads and strong
decay; a model whose GatedDeltaNet layers use it gives the same logits and the same
greedy answers through the engine, with the prefix cache resuming mid-prompt. It is
installed only where its contract with mlx-lm holds (the layer's attributes, the tested
mlx-lm range); otherwise the layers keep mlx-lm's path and one log line says why."""

from __future__ import annotations

import logging
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import qwen3_5
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk
from mlx_lm.utils import load
from mlxd.actors.engine.kernels import linear_attention as la
from mlxd.actors.engine.loading.load import load_runner
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.actors.engine.scheduler.options import PrefixCacheOptions

from tests.engine_driver import request, until_idle

pytestmark = pytest.mark.mlx


def inputs(T, Hk=2, Hv=4, Dk=32, Dv=16, B=2, strong_decay=False, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk))
    k = mx.random.normal((B, T, Hk, Dk))
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv))
    a = mx.random.normal((B, T, Hv)) * (3.0 if strong_decay else 1.0)
    b = mx.random.normal((B, T, Hv))
    A_log = mx.log(mx.random.uniform(low=0.5, high=16.0 if strong_decay else 4.0, shape=(Hv,)))
    dt_bias = mx.random.normal((Hv,)) * 0.1
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    return q, k, v, a, b, A_log, dt_bias, state


@pytest.mark.parametrize("T", [1, 17, 64, 100, 257])
@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunked_equals_mlx_lm_recurrence(T, strong_decay):
    q, k, v, a, b, A_log, dt_bias, state = inputs(T, strong_decay=strong_decay)
    want_y, want_s = gated_delta_ops(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b), state)
    log_g = la._log_decay(A_log, a, dt_bias)
    got_y, got_s = la.chunked_gated_delta(q, k, v, log_g, mx.sigmoid(b), state)
    assert got_y.shape == want_y.shape and got_s.shape == want_s.shape
    assert mx.allclose(got_y, want_y, atol=2e-5, rtol=1e-4).item()
    assert mx.allclose(got_s, want_s, atol=2e-5, rtol=1e-4).item()


def test_no_state_starts_from_zeros():
    q, k, v, a, b, A_log, dt_bias, _ = inputs(70, Hk=4, Hv=4)
    want_y, want_s = gated_delta_ops(q, k, v, compute_g(A_log, a, dt_bias), mx.sigmoid(b))
    got_y, got_s = la.chunked_gated_delta(
        q, k, v, la._log_decay(A_log, a, dt_bias), mx.sigmoid(b), None
    )
    assert mx.allclose(got_y, want_y, atol=2e-5, rtol=1e-4).item()
    assert mx.allclose(got_s, want_s, atol=2e-5, rtol=1e-4).item()


def _model(path):
    model, _ = load(str(path))
    return model


def test_install_swaps_only_gated_delta_layers_and_keeps_logits(tiny_models):
    path = tiny_models("qwen3_5")
    plain, chunked = _model(path), _model(path)
    layers = [m for _, m in plain.named_modules() if type(m) is qwen3_5.GatedDeltaNet]
    assert layers and la.install(chunked) == len(layers)
    assert la.install(chunked) == 0  # already installed: nothing left to swap
    tokens = mx.array([[(t * 131) % 5000 + 10 for t in range(150)]])
    calls = []
    original = la.chunked_gated_delta

    def counted(*args, **kwargs):
        calls.append(args[0].shape[1])
        return original(*args, **kwargs)

    la.chunked_gated_delta = counted
    try:
        for model in (plain, chunked):
            cache = make_prompt_cache(model)
            first = model(tokens[:, :100], cache=cache)  # prefill: the chunked path
            second = model(tokens[:, 100:101], cache=cache)  # decode: mlx-lm's step
            third = model(tokens[:, 101:], cache=cache)
            if model is plain:
                want = (first, second, third)
            else:
                got = (first, second, third)
    finally:
        la.chunked_gated_delta = original
    assert calls == [100] * len(layers) + [49] * len(layers)
    for w, g in zip(want, got, strict=True):
        assert mx.allclose(w, g, atol=1e-4, rtol=1e-3).item()


def test_engine_answers_equal_with_and_without_chunked_prefill(tiny_models):
    path = tiny_models("qwen3_5")
    prompts = {
        "warm": tuple(range(1000, 1000 + 130)),
        "hit": tuple(range(1000, 1000 + 128)) + (5, 6, 7, 8, 9),  # resumes at 128
        "other": tuple((t * 53) % 4000 + 20 for t in range(200)),
    }

    def answers(chunked: bool):
        options = PrefixCacheOptions(block_size=64, max_bytes=1 << 30)
        runner, _ = load_runner(
            str(path),
            path,
            dequantize_on_cpu=True,
            max_batch=4,
            prefix_cache=options,
            chunked_linear_attention=chunked,
        )
        core = EngineCore(runner, max_batch=4, prefill_chunk_tokens=256)
        out: dict[str, list[int]] = {}
        for rid, prompt in prompts.items():  # one after another: "hit" finds "warm"'s snapshot
            core.submit(request(rid, prompt, max_tokens=8))
            out |= until_idle(core)
        return out, runner

    chunked, runner = answers(True)
    assert any(isinstance(m, la.ChunkedPrefill) for _, m in runner.model.named_modules())
    plain, runner = answers(False)
    assert not any(isinstance(m, la.ChunkedPrefill) for _, m in runner.model.named_modules())
    assert chunked == plain


# ---- the contract with mlx-lm -------------------------------------------------------------


class GatedDeltaNet(nn.Module):
    """Named as mlx-lm's layer and claiming its module, but missing ``in_proj_qkv``."""

    __module__ = la.LAYER_CLASS[0]

    def __init__(self):
        super().__init__()
        for name in la.LAYER_ATTRIBUTES:
            if name != "in_proj_qkv":
                setattr(self, name, None)


class Holder(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layers = [layer]


def _refusals(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "keep mlx-lm's own prefill" in r.getMessage()]


def test_a_layer_missing_an_attribute_is_left_alone(caplog):
    model = Holder(GatedDeltaNet())
    with caplog.at_level(logging.INFO, logger="mlxd.runner"):
        assert la.install(model, mlx_lm_version=la.TESTED_MLX_LM[0]) == 0
    assert type(model.layers[0]) is GatedDeltaNet
    (line,) = _refusals(caplog)
    assert "in_proj_qkv" in line


@pytest.mark.parametrize("version", ["0.33.0", "0.32.1", "1.0", "0.33.0rc1"])
def test_an_mlx_lm_outside_the_tested_range_is_left_alone(tiny_models, caplog, version):
    model = _model(tiny_models("qwen3_5"))
    with caplog.at_level(logging.INFO, logger="mlxd.runner"):
        assert la.install(model, mlx_lm_version=version) == 0
    assert not any(isinstance(m, la.ChunkedPrefill) for _, m in model.named_modules())
    (line,) = _refusals(caplog)
    assert version in line and ">=0.32.2,<0.33" in line


def test_the_installed_mlx_lm_is_in_the_tested_range(tiny_models, caplog):
    """The real tiny Qwen3.5 gets it with the mlx-lm this project installs, silently."""
    model = _model(tiny_models("qwen3_5"))
    layers = [m for _, m in model.named_modules() if type(m) is qwen3_5.GatedDeltaNet]
    with caplog.at_level(logging.INFO, logger="mlxd.runner"):
        assert layers and la.install(model) == len(layers)
    assert not _refusals(caplog)
    assert all(
        isinstance(m, la.ChunkedPrefill) and isinstance(m, qwen3_5.GatedDeltaNet) for m in layers
    )


def test_release_parsing():
    assert la._release("0.32.2") == (0, 32, 2)
    assert la._release("0.33") == la._release("0.33.0") == (0, 33, 0)
    assert la._release("0.32.2.dev1") == (0, 32, 2)  # pre-release parts are dropped
    assert la._release("0.33.0rc1") == (0, 33, 0)


def test_the_loader_imports_no_architecture_module():
    """Loading the engine imports no model architecture's module of mlx-lm or mlx-vlm:
    each arrives when a model of that architecture loads."""
    code = (
        "import sys, mlxd.actors.engine.loading.load\n"
        "print(sorted(m for m in sys.modules if m.startswith(('mlx_lm.models.', "
        "'mlx_vlm.models.')) and m.rsplit('.', 1)[1] not in ('base', 'cache')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
