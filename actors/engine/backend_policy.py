"""Defaults that depend on the MLX backend (cpu / cuda / metal), in one table.

Each value names the measurement behind it. A setting given explicitly (config file,
flag) overrides the table; ``"auto"`` (None here) takes the table's value for the
backend the model loaded on. The CPU row is measured by mlxd's own benchmarks on a
2-core VM (README, Benchmarks); the cuda and metal rows come from the H200 probe of
issue 30 (a 2,000-token prefill pass costs little more than a 512-token one; short
waiting prompts prefilled together in one pass, as mlx-lm's ``BatchGenerator`` does)
and are not yet measured by mlxd's own benchmarks. Plain Python: no trio, no mlx at
import (``detect`` imports mlx when called, on the generation thread).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["BACKENDS", "BackendPolicy", "PrefillChoice", "detect", "for_backend", "prefill"]


@dataclass(frozen=True)
class BackendPolicy:
    """One backend's defaults; see the table below for the measurement behind each."""

    prefill_chunk_tokens: int  # prompt tokens prefilled per engine step
    prefill_unsplit_tokens: int  # a prompt with this few tokens left is not split
    batch_prefill: bool  # every request prefilled in a step shares forward passes
    # where batch_prefill is off: rows whose context stays within this many tokens still
    # share one (padded) pass; 0: none
    batch_prefill_max_context: int
    prefill_streams: int  # MLX streams a prefill chunk is split over
    # warm-up before "ready" with engine.warmup = "auto": the largest decode batch run
    # (0: the model's max_batch), and whether a full prefill chunk is run
    warmup_max_batch: int
    warmup_full_chunk: bool
    # tool_choice auto, a row writing free text whose format opens calls with a special
    # token: the mask after that token is chosen on the device from the row's newest token
    # (True), or the row reads its newest token on the host each step (False)
    opener_mask_on_device: bool


_GPU = BackendPolicy(
    # H200 probe: a 2,000-token pass costs little more than a 512-token one, so a step
    # takes four times the prompt for about the same stall of the running streams
    prefill_chunk_tokens=2048,
    # not measured on a GPU: the CPU's value (a short prompt is not split in two)
    prefill_unsplit_tokens=128,
    # H200 probe: one pass over several short prompts fills the GPU that one leaves idle
    batch_prefill=True,
    batch_prefill_max_context=0,  # unused: every row is batched
    # one queue per device: one chunk already fills it (H200 probe, not measured by mlxd)
    prefill_streams=1,
    # kernels are built (CUDA: NVRTC; Metal: JIT) on their first use per shape class:
    # every batch size up to the model's max_batch and a full chunk, before "ready"
    warmup_max_batch=0,
    warmup_full_chunk=True,
    # not measured on a GPU: a select over the vocabulary is microseconds there, while a
    # read of the newest token would stall the step that mlx-lm has already launched
    opener_mask_on_device=True,
)

BACKENDS: dict[str, BackendPolicy] = {
    "cpu": BackendPolicy(
        # 512: a step's pass stalls the running streams ~1 s on 2 cores (README, Benchmarks)
        prefill_chunk_tokens=512,
        # 32 chat prompts of ~65 tokens: a 512-token pass took 1.4 s with a split tail
        # row, 1.0 s without (bench_chat, in-process: wall x0.90, TTFT p50 x0.75)
        prefill_unsplit_tokens=128,
        # bench_step: batched prefill x1.03 at 512 tokens of context, x0.91 at 2048
        batch_prefill=False,
        # bench_step: eight chat prompts together x1.21 at 62 tokens, x1.14 at 94, x0.78
        # at 158 (a short turn leaves the BLAS half idle)
        batch_prefill_max_context=128,
        # bench_step: two pieces per chunk keep two cores busy; four ran slower than two
        # (the softmax threads and the BLAS contend); 1 on a one-core machine
        prefill_streams=2,
        # no per-shape kernel build on the CPU: the one-time cost (mx.compile traces, the
        # fused kernels' C++ build) is paid by one short pass of each path (tiny llama:
        # first request 0.73 s, the next 0.07 s); a full sweep would be seconds of compute
        warmup_max_batch=2,
        warmup_full_chunk=False,
        # bench_grammar (Qwen3.5's 248k vocabulary, 32 rows): the select cost 0.50 ms of
        # device work per free row per step (tools constrained x0.85 of tools free); the
        # host read of the newest token costs about 0.02 ms, and the CPU's "device" is the
        # same two cores, so there is little overlap to lose
        opener_mask_on_device=False,
    ),
    "cuda": _GPU,
    "metal": _GPU,  # same source as cuda: the H200 probe, not measured on Apple silicon
}


def for_backend(backend: str) -> BackendPolicy:
    """The backend's row; an unknown backend (a test's fake runner) gets the CPU's,
    the one mlxd has measured."""
    return BACKENDS.get(backend, BACKENDS["cpu"])


def detect() -> str:
    """The MLX backend this process computes on: metal, cuda or cpu (imports mlx)."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


@dataclass(frozen=True)
class PrefillChoice:
    """The loader's prefill settings for one backend, each the explicit setting or the
    table's: streams per chunk, and which rows the runner batches when the engine hands
    it several (``batch_every``: all; else those within ``max_context``; 0: none)."""

    streams: int
    batch_every: bool
    max_context: int

    @property
    def pays(self) -> bool:
        """Whether the engine hands the runner several requests' chunks by default."""
        return self.batch_every or self.max_context > 0


def prefill(
    backend: str,
    *,
    streams: int | None = None,
    batch_prefill: bool | None = None,
    max_context: int | None = None,
) -> PrefillChoice:
    """Explicit values (not None) win over the table. An explicit ``batch_prefill``
    decides alone (true: every row, false: none); ``max_context`` applies where it is
    "auto" and the table batches only short rows."""
    row = for_backend(backend)
    if streams is None:
        streams = row.prefill_streams if (os.cpu_count() or 1) >= 2 else 1
    if batch_prefill is not None:
        return PrefillChoice(streams, batch_prefill, 0)
    if row.batch_prefill:
        return PrefillChoice(streams, True, 0)
    return PrefillChoice(
        streams, False, row.batch_prefill_max_context if max_context is None else max_context
    )


def chunk_tokens(backend: str, wanted: int | None) -> int:
    """``engine.prefill_chunk_tokens`` (None: the table's)."""
    return for_backend(backend).prefill_chunk_tokens if wanted is None else wanted


def unsplit_tokens(backend: str, wanted: int | None) -> int:
    """``engine.prefill_unsplit_tokens`` (None: the table's)."""
    return for_backend(backend).prefill_unsplit_tokens if wanted is None else wanted
