"""Chunked prefill for Qwen3.5's GatedDeltaNet layers where mlx-lm has no kernel for it.

mlx-lm runs the gated delta rule with a Metal kernel on Apple GPUs. Elsewhere (the CPU
backend) it falls back to a Python loop over the prompt's tokens: one small recurrent
step per token per layer, each a few elementwise ops on a [heads, Dv, Dk] state. For a
512-token chunk that is thousands of dependent small ops per layer, single-threaded,
and on the CPU backend it is most of a hybrid model's prefill.

This module computes the same recurrence chunk by chunk (the WY form of the delta rule,
as in the Gated DeltaNet paper): within a chunk of C tokens everything but a short
state update is matrix products, computed for all chunks at once, and only one small
state update per chunk runs in order. Per head, with the state S (Dv x Dk) at a
chunk's start, decay g_t, cumulative decay G_t = g_1...g_t within the chunk, and
beta_t, the step's update u_t = beta_t (v_t - g_t S_{t-1} k_t) satisfies

    u_t + beta_t sum_{i<t} (G_t / G_i) (k_t . k_i) u_i = beta_t (v_t - G_t S k_t)

so U = (I + A)^-1 (beta V) - (I + A)^-1 (beta G K) S^T with A strictly lower
triangular (one triangular solve per chunk, for all chunks at once). Then

    y_t = G_t S q_t + sum_{i<=t} (G_t / G_i) (q_t . k_i) u_i
    S' = G_C S + sum_i (G_C / G_i) u_i k_i^T

Decay ratios are exp of differences of cumulative log-decays, never above 1.

``install(model)`` gives the model's own GatedDeltaNet instances a subclass of their
class (``ChunkedPrefill`` mixed in), whose ``__call__`` takes the chunked path for
prefill on the CPU (several tokens, no padding mask, no batch lengths, not sharded) and
defers to mlx-lm's for everything else (decode steps, padded batches, GPU streams: MLX's
triangular solve is a CPU op). The library's modules are not changed, nor imported here:
the layers are found by their class's module and name. Equal to mlx-lm's recurrence
within float32 rounding (``tests/test_linear_attention.py``).

The contract with mlx-lm: ``_prefill`` is a copy of mlx-lm 0.32.2's GatedDeltaNet
prefill, reading the layer attributes in ``LAYER_ATTRIBUTES``, the cache's in
``CACHE_ATTRIBUTES`` and ``mlx_lm.models.gated_delta.normalize_qk``. ``install`` swaps
only where all of them are there and the installed mlx-lm is in ``TESTED_MLX_LM``;
otherwise the layers keep mlx-lm's own path and one log line says why.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import re
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

log = logging.getLogger("mlxd.runner")

# The mlx-lm releases whose GatedDeltaNet ``_prefill`` was checked against (it copies
# 0.32.2's): at least the first, below the second. Outside it mlx-lm's own path runs.
TESTED_MLX_LM = ("0.32.2", "0.33")
# The layer class that gets the chunked prefill: its module and name in mlx-lm.
LAYER_CLASS = ("mlx_lm.models.qwen3_5", "GatedDeltaNet")
# What ``ChunkedPrefill`` reads of each such layer.
LAYER_ATTRIBUTES = (
    "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj",
    "A_log", "dt_bias", "num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim",
    "key_dim", "conv_dim", "conv_kernel_size", "sharding_group",
)  # fmt: skip
# ... of the layer's cache (an ``ArraysCache``: conv state in [0], SSM state in [1]) ...
CACHE_ATTRIBUTES = ("lengths", "advance", "__getitem__", "__setitem__")
# ... and of mlx-lm's shared gated-delta helpers.
LIBRARY_FUNCTIONS = (("mlx_lm.models.gated_delta", "normalize_qk"),)

# Tokens per chunk. Measured on the hybrid of ``scripts/bench_agents.py`` (512 new tokens,
# 2 prefill streams): 64 took 1.3 s where 32 took 2.3 s (alone, 32 was a little faster,
# but its longer chain of small ops kept the two streams from overlapping); 128 made the
# triangular solve 6x slower.
CHUNK = 64
MIN_TOKENS = 16  # fewer new tokens (decode, speculative verify): mlx-lm's own step


def chunked_gated_delta(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: mx.array,
    beta: mx.array,
    state: mx.array | None,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule over T tokens, chunked.

    Shapes as mlx-lm's ``gated_delta_ops``: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv];
    log_g (the log of the per-head scalar decay) and beta [B, T, Hv]; state
    [B, Hv, Dv, Dk] or None (zeros). Returns y [B, T, Hv, Dv] in q's dtype and the
    final state (float32)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[-2:]
    dtype = q.dtype
    if Hv > Hk:
        q = mx.repeat(q, Hv // Hk, axis=-2)
        k = mx.repeat(k, Hv // Hk, axis=-2)
    f32 = mx.float32
    # [B, H, T, D], padded to whole chunks: padding has beta 0, k 0 and decay 1 (log 0),
    # so it neither reads nor changes the state
    pad = -T % chunk
    n = (T + pad) // chunk

    def heads_first(x: mx.array) -> mx.array:
        x = x.astype(f32)
        x = mx.moveaxis(x, 2, 1) if x.ndim == 4 else x.swapaxes(1, 2)
        if pad:
            widths = [(0, 0)] * x.ndim
            widths[2] = (0, pad)
            x = mx.pad(x, widths)
        return x.reshape(B, Hv, n, chunk, *x.shape[3:])

    q, k, v = heads_first(q), heads_first(k), heads_first(v)  # [B, H, N, C, D]
    log_g, beta = heads_first(log_g), heads_first(beta)  # [B, H, N, C]
    s = mx.zeros((B, Hv, Dv, Dk), dtype=f32) if state is None else state.astype(f32)
    y, s = _across_chunks(_within_chunks(q, k, v, log_g, beta), s)
    y = y.reshape(B, Hv, n * chunk, Dv)[:, :, :T]
    return mx.moveaxis(y, 1, 2).astype(dtype), s


def _within_chunks(
    q: mx.array, k: mx.array, v: mx.array, log_g: mx.array, beta: mx.array
) -> tuple[mx.array, ...]:
    """Everything that does not depend on the state entering a chunk, for all chunks at
    once ([B, H, N, C, ...] inputs): U = w_v - w_k S^T (one triangular solve per chunk),
    y = gq S^T + qk U, and the state's decay ``end`` and increments ``to_end``."""
    chunk, Dv = v.shape[-2:]
    cum = mx.cumsum(log_g, axis=-1)  # log G_t within each chunk
    diff = cum[..., :, None] - cum[..., None, :]  # log(G_t / G_i)
    rows = mx.arange(chunk)
    causal = rows[:, None] >= rows[None, :]
    strict = rows[:, None] > rows[None, :]
    decay = mx.exp(mx.where(causal, diff, -mx.inf))  # G_t / G_i for i <= t, else 0

    kk = k @ k.swapaxes(-1, -2)
    a = mx.where(strict, decay * kk * beta[..., :, None], 0.0)
    eye = mx.eye(chunk, dtype=mx.float32)
    gamma = mx.exp(cum)[..., None]  # G_t
    rhs = mx.concatenate([beta[..., None] * v, beta[..., None] * gamma * k], axis=-1)
    width = rhs.shape[-1]
    solved = mx.linalg.solve_triangular(
        (eye + a).reshape(-1, chunk, chunk), rhs.reshape(-1, chunk, width), upper=False
    ).reshape(rhs.shape)
    w_v, w_k = solved[..., :Dv], solved[..., Dv:]

    qk = decay * (q @ k.swapaxes(-1, -2))  # (G_t / G_i) (q_t . k_i), i <= t
    gq = gamma * q
    to_end = mx.exp(cum[..., -1:] - cum)[..., None] * k  # (G_C / G_i) k_i
    end = mx.exp(cum[..., -1])[..., None, None]  # G_C
    return w_v, w_k, gq, qk, to_end, end


def _across_chunks(parts: tuple[mx.array, ...], s: mx.array) -> tuple[mx.array, mx.array]:
    """The one sequential part: carry the state S through the chunks in order. Returns
    y [B, H, N, C, Dv] and the final state."""
    w_v, w_k, gq, qk, to_end, end = parts
    ys = []
    for c in range(w_v.shape[2]):
        s_t = s.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        u = w_v[:, :, c] - w_k[:, :, c] @ s_t
        ys.append(gq[:, :, c] @ s_t + qk[:, :, c] @ u)
        s = end[:, :, c] * s + u.swapaxes(-1, -2) @ to_end[:, :, c]
    return mx.stack(ys, axis=2), s


def _log_decay(A_log: mx.array, a: mx.array, dt_bias: mx.array) -> mx.array:
    """log g for mlx-lm's ``compute_g`` (g = exp(-exp(A_log) * softplus(a + dt_bias)))."""
    return -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias).astype(mx.float32)


class ChunkedPrefill:
    """Mixed into mlx-lm's Qwen3.5 GatedDeltaNet by ``install``: its prefill runs
    ``chunked_gated_delta``; everything else is mlx-lm's own ``__call__``."""

    def __call__(self: Any, inputs: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        steps = inputs.shape[1]
        plain = (
            steps < MIN_TOKENS
            or mask is not None
            or self.sharding_group is not None
            or self.training
            or (cache is not None and cache.lengths is not None)
            or mx.default_device() != mx.cpu  # a GPU: mlx-lm's kernel, or its loop
        )
        if plain:
            return super().__call__(inputs, mask=mask, cache=cache)
        return self._prefill(inputs, cache)

    def _prefill(self: Any, x: mx.array, cache: Any) -> mx.array:
        from mlx_lm.models.gated_delta import normalize_qk  # checked by ``install``

        batch, steps, _ = x.shape
        mixed = self.in_proj_qkv(x)
        gate = self.in_proj_z(x).reshape(batch, steps, self.num_v_heads, self.head_v_dim)
        b, a = self.in_proj_b(x), self.in_proj_a(x)
        window = self.conv_kernel_size - 1  # inputs the depthwise conv needs from before
        held = cache[0] if cache is not None else None
        if held is None:
            held = mx.zeros((batch, window, self.conv_dim), dtype=x.dtype)
        conv_in = mx.concatenate([held, mixed], axis=1)
        if cache is not None:
            cache[0] = mx.contiguous(conv_in[:, -window:, :])
        conv = nn.silu(self.conv1d(conv_in))
        q, k, v = mx.split(conv, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(batch, steps, self.num_k_heads, self.head_k_dim)
        k = k.reshape(batch, steps, self.num_k_heads, self.head_k_dim)
        v = v.reshape(batch, steps, self.num_v_heads, self.head_v_dim)
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)
        state = cache[1] if cache is not None else None
        log_g = _log_decay(self.A_log, a, self.dt_bias)
        y, state = chunked_gated_delta(q, k, v, log_g, mx.sigmoid(b), state)
        if cache is not None:
            cache[1] = state
            cache.advance(steps)
        y = self.norm(y, gate)
        return self.out_proj(y.reshape(batch, steps, -1))


def applies() -> bool:
    """Where ``install`` pays: no Metal kernel (mlx-lm's loop runs) and the CPU backend
    (the triangular solve is a CPU op in MLX)."""
    return not mx.metal.is_available() and mx.default_device() == mx.cpu


def install(model: nn.Module, mlx_lm_version: str | None = None) -> int:
    """Give every mlx-lm Qwen3.5 GatedDeltaNet in ``model`` the chunked prefill; return
    how many layers now have it (0: the model has none, or the contract does not hold:
    then one log line says why). ``mlx_lm_version``: the installed one unless given."""
    layers = [m for _, m in model.named_modules() if _is_layer(m)]
    if not layers:
        return 0
    why = unsupported(layers, mlx_lm_version or installed_mlx_lm())
    if why is not None:
        log.warning("GatedDeltaNet layers keep mlx-lm's own prefill: %s", why)
        return 0
    for layer in layers:
        layer.__class__ = _chunked(type(layer))
    return len(layers)


def _is_layer(module: nn.Module) -> bool:
    cls = type(module)
    return (cls.__module__, cls.__name__) == LAYER_CLASS


def unsupported(layers: list[nn.Module], mlx_lm_version: str) -> str | None:
    """Why the chunked prefill cannot take over ``layers`` (None: it can)."""
    low, high = TESTED_MLX_LM
    if not _release(low) <= _release(mlx_lm_version) < _release(high):
        return f"mlx-lm {mlx_lm_version} is outside the tested range >={low},<{high}"
    for layer in layers:
        missing = [name for name in LAYER_ATTRIBUTES if not hasattr(layer, name)]
        if missing:
            return f"{type(layer).__name__} has no {', '.join(missing)}"
    cache = ArraysCache(2)
    missing = [name for name in CACHE_ATTRIBUTES if not hasattr(cache, name)]
    if missing:
        return f"ArraysCache has no {', '.join(missing)}"
    for module, name in LIBRARY_FUNCTIONS:
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            return f"{module}.{name} is missing"
    return None


def installed_mlx_lm() -> str:
    return importlib.metadata.version("mlx-lm")


def _release(version: str) -> tuple[int, ...]:
    """``"0.32.2"`` → ``(0, 32, 2)``; pre-release and local parts are dropped, missing
    parts are 0 (``"0.33"`` == ``"0.33.0"``)."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    parts = tuple(int(p) for p in match.group().split(".")) if match else (0,)
    return parts + (0,) * (3 - len(parts))


@functools.cache
def _chunked(base: type) -> type:
    """``base`` (mlx-lm's layer class) with ``ChunkedPrefill`` mixed in, made once."""
    return type(f"Chunked{base.__name__}", (ChunkedPrefill, base), {"__module__": __name__})
