"""``MlxRunner`` with speculative decoding: same protocol, decode through ``SpeculativeBatch``.

Prefill is the plain runner's (per-request, chunked, prefix cache); the draft
model follows each request's prefill on its own cache, catching up chunk by
chunk. At the join both caches enter the speculative batch, which decodes every
running request; above ``max_batch`` rows it decodes them one token a step.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from actors.engine.runner import MlxRunner, Pending, make_processors
from actors.engine.speculative import (
    SpecRow,
    SpecStats,
    SpeculativeBatch,
    UnsupportedForSpeculation,
    check_rewindable,
)
from actors.engine.types import Decoded
from protocol.messages import TokenizedRequest

log = logging.getLogger("mlxd.speculative")


class SpeculativeRunner(MlxRunner):
    """Draft-model speculative decoding inside the continuous batch."""

    def __init__(
        self,
        model: nn.Module,
        draft: nn.Module,
        stop_tokens: list[int],
        max_batch: int,
        *,
        num_draft: int,
        spec_max_batch: int,
        drafter: str = "draft model",
        prefix_cache: Any = None,
        spec_prefill: Any = None,
    ):
        super().__init__(
            model, stop_tokens, max_batch, prefix_cache=prefix_cache, spec_prefill=spec_prefill
        )
        self.draft = draft
        check_rewindable(self._make_cache())
        check_rewindable(make_prompt_cache(draft))
        self.spec_stats = SpecStats(
            drafter=drafter, num_draft_tokens=num_draft, max_batch=spec_max_batch
        )
        self._batch_args = (num_draft, spec_max_batch, stop_tokens)
        self.batch = self._new_batch()
        self._drafts: dict[str, tuple[list[Any], int]] = {}  # draft cache, tokens in it

    def _new_batch(self) -> SpeculativeBatch:
        num_draft, spec_max_batch, stop_tokens = self._batch_args
        return SpeculativeBatch(
            self.model,
            self.draft,
            num_draft=num_draft,
            max_batch=spec_max_batch,
            stop_tokens=stop_tokens,
            stats=self.spec_stats,
        )

    def reset(self) -> None:
        """After a failed decode step: a fresh speculative batch too."""
        super().reset()
        self.batch = self._new_batch()

    @property
    def decoding(self) -> int:
        return len(self.batch)

    @property
    def cache_bytes(self) -> int:
        pending = sum(c.nbytes for p in self._pending.values() for c in p.cache)
        drafts = sum(c.nbytes for cache, _ in self._drafts.values() for c in cache)
        return pending + drafts + self.batch.nbytes

    def start(self, request: TokenizedRequest) -> int:
        done = super().start(request)
        self._drafts[request.request_id] = (make_prompt_cache(self.draft), 0)
        return done

    def _prefill_chunk(self, pending: Pending, n: int) -> None:
        super()._prefill_chunk(pending, n)
        self._draft_catch_up(pending.request, pending.done + n)

    def _draft_catch_up(self, request: TokenizedRequest, upto: int) -> None:
        cache, done = self._drafts[request.request_id]
        if upto > done:
            self.draft(mx.array(request.prompt_tokens[done:upto])[None], cache=cache)
            mx.eval([c.state for c in cache])
            self._drafts[request.request_id] = (cache, upto)

    def _join_batch(self, pending: Pending) -> None:
        request = pending.request
        if request.grammar is not None or request.sampling.logprobs:
            # A grammar matcher advances once per token and cannot be rolled back per row.
            raise ValueError(
                "structured output, forced tool calls and logprobs are not available "
                "while speculative decoding is on (speculative.enabled)"
            )
        prompt = list(request.prompt_tokens)
        cache = self._joining(pending)
        with mx.stream(self._stream):
            self._draft_catch_up(request, len(prompt) - 1)
        draft_cache, _ = self._drafts.pop(request.request_id)
        params = request.sampling
        row = SpecRow(
            request_id=request.request_id,
            tokens=prompt,
            max_tokens=params.max_tokens,
            params=params,
            processors=make_processors(params),
            key=mx.random.key(params.seed) if params.seed is not None else None,
            draft_pending=[prompt[-1]],
        )
        self.batch.add(row, cache, draft_cache)

    def decode(self) -> list[Decoded]:
        if not len(self.batch):
            return []
        with mx.stream(self._stream):
            emitted = self.batch.step()
        out = []
        for e in emitted:
            for n, token in enumerate(e.tokens, 1):
                out.append(
                    Decoded(e.request_id, token, e.finish_reason if n == len(e.tokens) else None)
                )
            if e.finish_reason is not None:
                self._remember_finished(e.request_id, e.cache_tokens, e.cache)
        return out

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._drafts.pop(request_id, None)
        gone = self.batch.remove(request_id)
        if gone is not None:
            self._remember_finished(request_id, gone.cache_tokens, gone.cache)
        self._sparse.discard(request_id)


def make_speculative_runner(
    model: nn.Module,
    draft: nn.Module,
    stop_tokens: list[int],
    max_batch: int,
    settings: Any,
    prefix_cache: Any,
    drafter: str,
    spec_prefill: Any = None,
) -> MlxRunner:
    """A ``SpeculativeRunner``; a plain runner (and a logged reason) if the model can't rewind."""
    try:
        return SpeculativeRunner(
            model,
            draft,
            stop_tokens,
            max_batch,
            num_draft=settings.num_draft_tokens,
            spec_max_batch=settings.max_batch,
            drafter=drafter,
            prefix_cache=prefix_cache,
            spec_prefill=spec_prefill,
        )
    except UnsupportedForSpeculation as exc:
        log.warning("speculative decoding is off for this model: %s", exc)
        runner = MlxRunner(
            model, stop_tokens, max_batch, prefix_cache=prefix_cache, spec_prefill=spec_prefill
        )
        runner.spec_stats = SpecStats(drafter=drafter, notes=[f"off: {exc}"])  # type: ignore[attr-defined]
        return runner
