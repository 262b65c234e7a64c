"""Warm-up: the shapes serving meets, run once between a model's load and its first request.

MLX builds a kernel the first time it meets it (CUDA: NVRTC; Metal: its JIT library;
the CPU: the C++ of ``mx.compile``'s fused kernels) and ``mx.compile`` traces a function
per input shape, so without a warm-up the first requests pay for it: a cold-start
stall. Here a throwaway ``EngineCore`` over the loaded runner runs requests no client
sent, through the same scheduling policy as serving: one long prompt alone (a full
prefill chunk, then its tail), then ``batch`` short prompts at once, prefilled
together where the backend batches prefill, decoding while they finish one step
apart, so the decode batch passes through every size from ``batch`` down to 1. One
row samples with its own seed (the sampling chain, without touching the global RNG)
and one asks for logprobs; the rest are greedy (the all-greedy batch path).

The runner's ``warming_up()`` keeps these requests out of its prefix cache and gives
the buffers back afterwards; the core is dropped, so no counter of the served core
sees them. Plain Python: no trio, no mlx.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.actors.engine.scheduler.types import Warmup
from mlxd.protocol.messages import SamplingParams, TokenizedRequest

log = logging.getLogger("mlxd.engine")

# About a chat turn's prompt (bench_chat's are ~65 tokens), within the CPU's
# batch_prefill_max_context, so the short rows share a pass there too.
_SHORT_TOKENS = 64
_TOKEN_RANGE = 1000  # prompt ids drawn from 1.._TOKEN_RANGE (every vocabulary has them)


class BackendWarmup(Protocol):
    """The backend's warm-up defaults (a row of ``actors/engine/backend_policy.py``, which
    the caller looks up: the scheduler imports nothing that imports mlx)."""

    warmup_max_batch: int
    warmup_full_chunk: bool


@dataclass(frozen=True)
class WarmupPlan:
    """What to run: ``batch`` short prompts of ``short_tokens`` decoded together (every
    batch size from ``batch`` down to 1), after one prompt of ``long_tokens`` (0: none)."""

    batch: int
    short_tokens: int = _SHORT_TOKENS
    long_tokens: int = 0


def plan(
    row: BackendWarmup, wanted: bool | None, max_batch: int, cap: int | None, chunk: int
) -> WarmupPlan | None:
    """``engine.warmup`` (None: "auto", the backend table's set; True: every batch size up
    to ``cap`` and a full chunk; False: none) for a core of ``max_batch`` rows and
    ``chunk``-token prefill steps. ``cap``: ``engine.warmup_max_batch`` (None: "auto";
    0: ``max_batch``)."""
    if wanted is False:
        return None
    if cap is None:
        cap = row.warmup_max_batch if wanted is None else 0
    batch = min(cap or max_batch, max_batch)
    full_chunk = wanted is True or row.warmup_full_chunk
    return WarmupPlan(batch=batch, long_tokens=chunk + _SHORT_TOKENS if full_chunk else 0)


def _prompt(seed: int, n: int, vocab_size: int) -> tuple[int, ...]:
    span = max(min(_TOKEN_RANGE, vocab_size - 1), 1)
    return tuple(1 + (seed * 613 + t) % span for t in range(n))


def _request(rid: str, prompt: tuple[int, ...], sampling: SamplingParams) -> TokenizedRequest:
    return TokenizedRequest(request_id=rid, prompt_tokens=prompt, sampling=sampling)


def requests(p: WarmupPlan, vocab_size: int) -> list[list[TokenizedRequest]]:
    """The warm-up's requests, in rounds: the long prompt alone, then the short ones."""
    rounds = []
    if p.long_tokens:
        greedy = SamplingParams(max_tokens=2, temperature=0.0)
        long = _prompt(0, p.long_tokens, vocab_size)
        rounds.append([_request("warmup-long", long, greedy)])
    short = []
    for i in range(p.batch):
        # row i decodes i + 2 tokens: the batch shrinks by one row per step
        sampling = SamplingParams(max_tokens=i + 2, temperature=0.0)
        if i == 0:
            sampling = SamplingParams(max_tokens=2, temperature=0.7, top_p=0.9, seed=0)
        elif i == 1:
            sampling = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=2)
        prompt = _prompt(i + 1, p.short_tokens, vocab_size)
        short.append(_request(f"warmup-{i}", prompt, sampling))
    return [*rounds, short]


def run(core: EngineCore, p: WarmupPlan, vocab_size: int) -> Warmup:
    """Run the plan's requests to the end on ``core``; a refused or failed request (the
    memory budget, an allocation) is logged, and the warm-up goes on without it."""
    started = time.monotonic()
    for round_ in requests(p, vocab_size):
        for request in round_:
            core.submit(request)
        while not core.idle:
            for failed in core.step().failed:
                log.warning("warm-up request %s: %s", failed.request_id, failed.message)
    prompts = (p.long_tokens,) if p.long_tokens else ()
    return Warmup(
        seconds=time.monotonic() - started,
        max_batch=p.batch,
        prompt_tokens=(*prompts, p.short_tokens),
    )
