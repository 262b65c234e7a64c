"""``MlxRunner`` with speculative decoding: same protocol, decode through ``SpeculativeBatch``.

Prefill is the plain runner's (per-request, chunked, prefix cache); the drafter
follows each request's prefill chunk by chunk (a draft model on its own cache; an
MTP head on the target's hidden states). At the join the target cache and the
drafter's state enter the speculative batch, which decodes every running request;
above ``max_batch`` rows it decodes them one token a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlxd.actors.engine.runner.base import MlxRunner, Pending, make_processors
from mlxd.actors.engine.runner.prefix_cache import PrefixCache
from mlxd.actors.engine.scheduler.options import SpeculativeOptions
from mlxd.actors.engine.scheduler.types import Decoded
from mlxd.actors.engine.speculative.batch import (
    Drafter,
    ModelDrafter,
    SpecRow,
    SpeculativeBatch,
    Target,
    UnsupportedForSpeculation,
    check_rewindable,
)
from mlxd.actors.engine.speculative.spec_prefill import SpecPrefill
from mlxd.protocol.messages import SpeculativeCounters, TokenizedRequest

log = logging.getLogger("mlxd.speculative")


class SpeculativeRunner(MlxRunner):
    """Speculative decoding (a draft model or an MTP head) inside the continuous batch."""

    def __init__(
        self,
        model: nn.Module,
        draft: nn.Module | Drafter,
        stop_tokens: list[int],
        max_batch: int,
        *,
        num_draft: int,
        spec_max_batch: int,
        drafter: str = "draft model",
        prefix_cache: PrefixCache | None = None,
        spec_prefill: SpecPrefill | None = None,
        make_cache: Callable[[], list[Any]] | None = None,
    ):
        super().__init__(
            model,
            stop_tokens,
            max_batch,
            prefix_cache=prefix_cache,
            spec_prefill=spec_prefill,
            make_cache=make_cache,
        )
        check_rewindable(self._make_cache())
        self._drafter_args = (draft, drafter)
        self.drafter = self._new_drafter()
        self.spec_stats = SpeculativeCounters(
            drafter=self.drafter.name,
            enabled=True,
            num_draft_tokens=num_draft,
            max_batch=spec_max_batch,
        )
        self._target = Target(model, self.drafter.wants_hidden)
        self._batch_args = (num_draft, spec_max_batch, stop_tokens)
        self.batch = self._new_batch()
        # A preempted seeded row's PRNG key as it left the batch: verification splits it a
        # varying number of times per emitted token, so its resume takes the key itself
        # rather than skipping draws. Bounded: a row aborted while preempted never rejoins.
        self._preempted_keys: dict[str, mx.array] = {}

    def _new_drafter(self) -> Drafter:
        draft, name = self._drafter_args
        if isinstance(draft, Drafter):
            return draft.fresh()
        return ModelDrafter(draft, name)

    def _new_batch(self) -> SpeculativeBatch:
        num_draft, spec_max_batch, stop_tokens = self._batch_args
        return SpeculativeBatch(
            self.model,
            self.drafter,
            num_draft=num_draft,
            max_batch=spec_max_batch,
            stop_tokens=stop_tokens,
            stats=self.spec_stats,
        )

    def reset(self) -> None:
        """After a failed decode step: a fresh speculative batch (and drafter state) too."""
        super().reset()
        prefilling = list(self._pending)
        self.drafter = self._new_drafter()
        for rid in prefilling:  # their drafter state starts over
            self.drafter.start(rid)
        self.batch = self._new_batch()

    @property
    def decoding(self) -> int:
        return len(self.batch)

    @property
    def cache_bytes(self) -> int:
        pending = sum(c.nbytes for p in self._pending.values() for c in p.cache)
        return pending + self.batch.nbytes  # the batch counts the drafter's state

    def start(self, request: TokenizedRequest) -> int:
        done = super().start(request)
        self.drafter.start(request.request_id)
        return done

    def _prefill_chunk(self, pending: Pending, n: int) -> None:
        prompt = pending.request.prompt_tokens
        chunk = mx.array(prompt[pending.done : pending.done + n])[None]
        hidden = self._target.hidden(chunk, pending.cache)
        self.drafter.prefilled(
            pending.request.request_id,
            prompt,
            pending.done + n,
            hidden if self.drafter.wants_hidden else None,
        )

    def _join_batch(self, pending: Pending) -> None:
        request = pending.request
        if request.grammar is not None or request.sampling.logprobs:
            # A grammar matcher advances once per token and cannot be rolled back per row.
            raise ValueError(
                "structured output, forced tool calls and logprobs are not available "
                "while speculative decoding is on (speculative.enabled)"
            )
        cache = self._joining(pending)
        key = self._preempted_keys.pop(request.request_id, None) if request.resumed else None
        with mx.stream(self._stream):
            join(self.batch, self.drafter, request, cache, key)

    def decode(self) -> list[Decoded]:
        out, finished = step(self.batch, self._stream)
        for e in finished:
            self._remember_finished(e.request_id, e.cache_tokens, e.cache)
        return out

    def preempt(self, request_id: str) -> int:
        row = next((r for r in self.batch.rows if r.request_id == request_id), None)
        if row is not None and row.key is not None:
            if len(self._preempted_keys) >= _MAX_PREEMPTED_KEYS:
                self._preempted_keys.pop(next(iter(self._preempted_keys)))
            self._preempted_keys[request_id] = row.key
        return super().preempt(request_id)

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self.drafter.forget(request_id)
        gone = self.batch.remove(request_id)
        if gone is not None:
            self._remember_finished(request_id, gone.cache_tokens, gone.cache)
        self._sparse.discard(request_id)
        self._keys.pop(request_id, None)


_MAX_PREEMPTED_KEYS = 4096


def seeded_key(params) -> mx.array | None:
    return mx.random.key(params.seed) if params.seed is not None else None


def join(
    batch: SpeculativeBatch,
    drafter: Drafter,
    request: TokenizedRequest,
    cache,
    key: mx.array | None = None,
) -> None:
    """A prefilled request (``cache`` holds its prompt but the last token) joins ``batch``;
    ``key``: a resumed seeded row's PRNG key where it left off."""
    prompt = list(request.prompt_tokens)
    draft_state = drafter.joined(request.request_id, prompt)
    params = request.sampling
    row = SpecRow(
        request_id=request.request_id,
        tokens=prompt,
        max_tokens=params.max_tokens,
        params=params,
        processors=make_processors(params),
        key=key if key is not None else seeded_key(params),
    )
    batch.add(row, cache, draft_state)


def step(batch: SpeculativeBatch, stream: Any) -> tuple[list[Decoded], list[Any]]:
    """One speculative step: each row's tokens as ``Decoded`` (the finish reason on the
    last), and the rows that finished (with their caches)."""
    if not len(batch):
        return [], []
    with mx.stream(stream):
        emitted = batch.step()
    out = []
    for e in emitted:
        for n, token in enumerate(e.tokens, 1):
            out.append(
                Decoded(e.request_id, token, e.finish_reason if n == len(e.tokens) else None)
            )
    return out, [e for e in emitted if e.finish_reason is not None]


def make_speculative_runner(
    model: nn.Module,
    draft: nn.Module | Drafter,
    stop_tokens: list[int],
    max_batch: int,
    options: SpeculativeOptions,
    prefix_cache: PrefixCache | None,
    drafter: str,
    spec_prefill: SpecPrefill | None = None,
    make_cache: Callable[[], list[Any]] | None = None,
) -> MlxRunner:
    """A ``SpeculativeRunner``; a plain runner (and a logged reason) if the model can't rewind.
    ``make_cache``: the target's cache factory (quantized KV); the drafter keeps its own."""
    try:
        return SpeculativeRunner(
            model,
            draft,
            stop_tokens,
            max_batch,
            num_draft=options.num_draft_tokens,
            spec_max_batch=options.max_batch,
            drafter=drafter,
            prefix_cache=prefix_cache,
            spec_prefill=spec_prefill,
            make_cache=make_cache,
        )
    except UnsupportedForSpeculation as exc:
        log.warning("speculative decoding is off for this model: %s", exc)
        runner = MlxRunner(
            model,
            stop_tokens,
            max_batch,
            prefix_cache=prefix_cache,
            spec_prefill=spec_prefill,
            make_cache=make_cache,
        )
        runner.spec_stats = SpeculativeCounters(drafter=drafter, notes=(f"off: {exc}",))
        return runner
