"""A vision model whose text backbone has an MTP head: text-only requests speculate.

``VlmMtpRunner`` keeps two decode lanes on the one generation thread:

- requests with images (and any request speculation cannot serve: grammar,
  logprobs, a non-zero M-RoPE delta) decode in mlx-lm's ``BatchGenerator`` exactly
  as in ``VlmRunner``;
- text-only requests decode in a ``SpeculativeBatch`` drafted by the MTP head, the
  verify pass going through mlx-vlm's language model (its own positions; a text-only
  prompt has M-RoPE delta 0, so text positions are the cache offsets).

Each engine step advances both lanes. Nothing is silently disabled: image requests
are counted nowhere as drafted, and ``GET /v1/status`` reports the head's
acceptance like a text model's.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlxd.actors.engine.runner.base import Pending
from mlxd.actors.engine.runner.vlm import VlmRunner
from mlxd.actors.engine.scheduler.types import Decoded
from mlxd.actors.engine.speculative.batch import SpeculativeBatch, check_rewindable
from mlxd.actors.engine.speculative.runner import join, step
from mlxd.protocol.messages import SpeculativeCounters, TokenizedRequest

log = logging.getLogger("mlxd.speculative")


class VlmTarget:
    """mlx-vlm's language model for text-only rows: logits and the last hidden state."""

    def __init__(self, language_model: nn.Module):
        self.lm = language_model

    def _run(self, ids: mx.array, cache: list[Any], logits: bool) -> Any:
        out = self.lm(
            ids,
            cache=cache,
            rope_deltas=mx.zeros((ids.shape[0], 1), mx.int32),
            return_hidden=True,
            skip_logits=not logits,
        )
        if not out.hidden_states:
            raise RuntimeError(f"{type(self.lm).__name__} returns no hidden states")
        return out.logits, out.hidden_states[-1]

    def __call__(self, ids: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        return self._run(ids, cache, logits=True)

    def hidden(self, ids: mx.array, cache: list[Any]) -> mx.array:
        return self._run(ids, cache, logits=False)[1]


class VlmMtpRunner(VlmRunner):
    """Image requests in the plain batch, text-only requests in the MTP speculative batch."""

    def __init__(
        self,
        model: nn.Module,
        stop_tokens: list[int],
        max_batch: int,
        *,
        drafter: Any,
        num_draft: int,
        spec_max_batch: int,
    ):
        super().__init__(model, stop_tokens, max_batch)
        check_rewindable(self._make_cache())
        self._drafter_proto = drafter
        self._target = VlmTarget(model.language_model)
        self.spec_stats = SpeculativeCounters(
            drafter=drafter.name,
            enabled=True,
            num_draft_tokens=num_draft,
            max_batch=spec_max_batch,
            notes=("vision model: text-only requests speculate",),
        )
        self._batch_args = (num_draft, spec_max_batch, stop_tokens)
        self._fresh_batch()

    def _fresh_batch(self) -> None:
        num_draft, spec_max_batch, stop_tokens = self._batch_args
        self.drafter = self._drafter_proto.fresh()
        self.batch = SpeculativeBatch(
            self.model,
            self.drafter,
            num_draft=num_draft,
            max_batch=spec_max_batch,
            stop_tokens=stop_tokens,
            stats=self.spec_stats,
            target=self._target,
        )

    @property
    def decoding(self) -> int:
        return super().decoding + len(self.batch)

    @property
    def cache_bytes(self) -> int:
        return super().cache_bytes + self.batch.nbytes

    def _speculates(self, request: TokenizedRequest) -> bool:
        return request.vision is None and request.grammar is None and not request.sampling.logprobs

    def start(self, request: TokenizedRequest) -> int:
        done = super().start(request)
        if self._speculates(request):
            self.drafter.start(request.request_id)
        return done

    def _prefill_chunk(self, pending: Pending, n: int) -> None:
        request = pending.request
        if not self._speculates(request):
            super()._prefill_chunk(pending, n)
            return
        prompt = self._prompt(pending)
        start, stop = pending.done, pending.done + n
        out = self.model.language_model(
            prompt.ids[:, start:stop],
            inputs_embeds=prompt.embeds[:, start:stop],
            cache=pending.cache,
            return_hidden=True,
            skip_logits=True,
            **prompt.kwargs,
        )
        self.drafter.prefilled(
            request.request_id, request.prompt_tokens, stop, out.hidden_states[-1]
        )

    def _join_batch(self, pending: Pending) -> None:
        request = pending.request
        deltas = self._prompt(pending).deltas
        if not self._speculates(request) or (deltas is not None and deltas.item() != 0):
            self.drafter.forget(request.request_id)
            super()._join_batch(pending)
            return
        cache = self._joining(pending)
        join(self.batch, self.drafter, request, cache)

    def decode(self) -> list[Decoded]:
        return super().decode() + step(self.batch, self._stream)[0]

    def remove(self, request_id: str) -> None:
        super().remove(request_id)
        self.drafter.forget(request_id)
        self.batch.remove(request_id)

    def reset(self) -> None:
        super().reset()
        prefilling = [rid for rid, p in self._pending.items() if self._speculates(p.request)]
        self._fresh_batch()
        for rid in prefilling:
            self.drafter.start(rid)
