"""Vision-language models (mlx-vlm) behind the same runner protocol as text models.

A request is prefilled alone, on the generation thread, exactly as mlx-vlm's own
``generate_step`` does it: ``model.get_input_embeddings`` runs the vision encoder
and merges image features into the prompt embeddings (text-only requests take the
same path without pixels), then the language model consumes the embeddings a chunk
per engine step into the request's own cache. That cache then joins mlx-lm's
``BatchGenerator`` like a text model's, so image and text requests decode in the
same batch, with per-request sampling.

M-RoPE models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5) place the tokens after an
image at positions that depend on the image grid: each sequence decodes at its
cache offset plus a per-sequence ``rope_delta``. The delta rides along the batch as
a ``RowDeltas`` entry at the end of the sequence's cache list, so BatchGenerator's
merge/filter/extend keep it in step with the sequence; each decode step passes the
batch's deltas to the language model (mlx-vlm's own batch decode contract).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlxd.actors.engine.runner.base import MlxRunner, Pending
from mlxd.actors.engine.runner.caches import RowDeltas

log = logging.getLogger("mlxd.runner")


@dataclass
class _Prompt:
    """A request's prompt as the language model consumes it (built once, on first prefill)."""

    ids: mx.array  # [1, L]
    embeds: mx.array  # [1, L, hidden]
    kwargs: dict[str, Any]  # position ids and other per-prompt model inputs
    deltas: mx.array | None  # [1, 1] M-RoPE delta, for models that use one


class _DecodeStep:
    """What BatchGenerator calls each decode step: the language model on token ids."""

    def __init__(self, language_model: nn.Module, carries_deltas: bool):
        self.language_model = language_model
        self.carries_deltas = carries_deltas

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        if not self.carries_deltas:
            return self.language_model(inputs, cache=cache).logits
        layers = cache[:-1]
        out = self.language_model(inputs, cache=layers, rope_deltas=cache[-1].values)
        cache[:-1] = layers  # some models swap a layer's cache object inside the list
        return out.logits


def _vision_arrays(request) -> dict[str, mx.array]:
    vision = request.vision
    if vision is None:
        return {}
    return {name: mx.array(value) for name, value in vision.arrays.items()}


class VlmRunner(MlxRunner):
    """Per-request vision encoding and chunked prefill, then the shared decode batch."""

    def __init__(self, model: nn.Module, stop_tokens: list[int], max_batch: int):
        # mlx-vlm is imported only when a vision model loads (``loading`` imports this
        # module for every model).
        from mlx_vlm.models.cache import make_prompt_cache

        language_model = model.language_model
        self.carries_deltas = _uses_rope_deltas(model)
        super().__init__(
            model,
            stop_tokens,
            max_batch,
            make_cache=lambda: make_prompt_cache(language_model),
            decode_model=_DecodeStep(language_model, self.carries_deltas),
        )

    def _prompt(self, pending: Pending) -> _Prompt:
        if pending.inputs is None:
            ids = mx.array(pending.request.prompt_tokens)[None]
            arrays = _vision_arrays(pending.request)
            pixels = arrays.pop("pixel_values", None)
            features = self.model.get_input_embeddings(ids, pixels, mask=None, **arrays)
            extra = {
                k: v
                for k, v in features.to_dict().items()
                if k != "inputs_embeds" and v is not None
            }
            deltas = None
            if self.carries_deltas:
                deltas = extra.get("rope_deltas")
                deltas = mx.zeros((1, 1), mx.int32) if deltas is None else deltas.reshape(1, 1)
            pending.inputs = _Prompt(ids, features.inputs_embeds, {**arrays, **extra}, deltas)
        return pending.inputs

    def _prefill_chunk(self, pending: Pending, n: int) -> None:
        prompt = self._prompt(pending)
        start, stop = pending.done, pending.done + n
        self.model.language_model(
            prompt.ids[:, start:stop],
            inputs_embeds=prompt.embeds[:, start:stop],
            cache=pending.cache,
            **prompt.kwargs,
        )

    def _probe(self, cache: list[Any]) -> None:
        self.model.language_model(mx.array([[0]]), cache=cache)

    def _batch_cache(self, pending: Pending) -> list[Any]:
        if not self.carries_deltas:
            return pending.cache
        return [*pending.cache, RowDeltas(self._prompt(pending).deltas)]


def _uses_rope_deltas(model: nn.Module) -> bool:
    """Whether the model positions tokens with a per-sequence M-RoPE delta."""
    features = model.get_input_embeddings(mx.array([[0]]), None)
    return getattr(features, "rope_deltas", None) is not None
