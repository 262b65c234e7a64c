"""Embedding runner: a model body with mlxd's pooling head, on the generation thread.

An embedding model (a ``[[models]]`` entry with ``kind = "embedding"``) runs one of two
bodies, and its language-model head (if any) never runs:

- decoder models (Qwen3-Embedding and the like: any architecture mlx-lm has) load
  through mlx-lm like a chat model: a model directory or a GGUF file, quantized weights
  dequantized on the CPU backend alike. The body is causal: a row's states never see
  the padding after it.
- encoder models (``ENCODERS``: BERT, XLM-RoBERTa, ModernBERT, which mlx-lm does not
  have) load through the ``mlx-embeddings`` package, whose bodies take an attention
  mask: padding is masked out of every row's attention.

The runner pads a batch of token lists on the right into one forward pass and pools
each row's hidden states over its own tokens only: ``mean``, the first token's
(``cls``) or the last one's (``last``), then L2-normalises. So an input gives the same
vector alone or in any batch (up to float rounding).

Contracts, checked at load: an mlx-lm model holds its body as ``model`` (or
``transformer`` / ``backbone`` / ``language_model``) and calling it on a (batch,
length) array of token ids returns hidden states (batch, length, hidden size)
(``find_body``); an mlx-embeddings model is of a tested version
(``MLX_EMBEDDINGS_TESTED``) and returns ``last_hidden_state`` of that shape for ids
and a mask (``load_encoder``). A model that does not is refused at load, with why.

Pooling comes from the entry's ``pooling`` setting, or, with ``auto``, from the
model's sentence-transformers files (``modules.json`` naming a ``Pooling`` module
whose ``config.json`` sets ``pooling_mode_*``); with neither, ``last`` for a decoder
(its only token that has seen the whole input) and ``mean`` for an encoder.
Matryoshka sizes come from the entry, or the model's ``config.json``
(``matryoshka_dimensions``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlxd.actors.engine.scheduler.options import EmbeddingOptions
from mlxd.protocol.embeddings import POOLINGS, EmbeddingInfo
from mlxd.protocol.messages import RunnerCounters

log = logging.getLogger("mlxd.runner")

_BODY_NAMES = ("model", "transformer", "backbone", "language_model")
# Encoder architectures mlx-lm lacks, run by mlx-embeddings (its model_type names).
ENCODERS = frozenset({"bert", "xlm-roberta", "xlm_roberta", "modernbert"})
MLX_EMBEDDINGS_TESTED = ((0, 1), (0, 2))  # versions [0.1, 0.2)
# A body: (token ids, mask) of shape (batch, length) → hidden states (batch, length, size).
Body = Callable[[mx.array, mx.array], mx.array]
_ST_POOLING = {  # sentence-transformers' pooling modes, as mlxd names them
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}


class EmbeddingRunner:
    """One embedding model: ``embed`` runs a padded batch and pools it (engine thread).
    ``options`` carries the engine's batching limits to its ``EmbeddingCore``."""

    def __init__(self, body: Body, info: EmbeddingInfo, options: EmbeddingOptions, pad_id=0):
        self.body, self.info, self.options, self.pad_id = body, info, options, pad_id

    def embed(self, batch: list[tuple[int, ...]]) -> np.ndarray:
        lengths = np.array([len(ids) for ids in batch], dtype=np.int32)
        ids = np.full((len(batch), int(lengths.max())), self.pad_id, dtype=np.int32)
        for row, tokens in enumerate(batch):
            ids[row, : len(tokens)] = tokens
        mask = (np.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(np.float32)
        hidden = self.body(mx.array(ids), mx.array(mask)).astype(mx.float32)
        pooled = pool(hidden, mx.array(lengths), self.info.pooling)
        if self.info.normalize:
            pooled = pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
        return np.array(pooled, dtype=np.float32)

    # ---- what the pool asks of any runner ----------------------------------------------

    def clear_cache(self) -> None:
        pass  # no prefix cache: every input is embedded whole

    def release_buffers(self) -> None:
        mx.clear_cache()

    def memory_stats(self) -> tuple[int, int]:
        return mx.get_active_memory(), mx.get_peak_memory()

    def counters(self) -> RunnerCounters:
        return RunnerCounters()


def pool(hidden: mx.array, lengths: mx.array, pooling: str) -> mx.array:
    """One vector per row of ``hidden`` (batch, length, size) from its first
    ``lengths[row]`` positions only."""
    if pooling == "cls":
        return hidden[:, 0, :]
    if pooling == "last":
        return hidden[mx.arange(hidden.shape[0]), lengths - 1, :]
    mask = (mx.arange(hidden.shape[1])[None, :] < lengths[:, None]).astype(hidden.dtype)
    return (hidden * mask[..., None]).sum(axis=1) / lengths[:, None].astype(hidden.dtype)


def find_body(model: nn.Module, hidden_size: int | None, vocab_size: int) -> Body:
    """An mlx-lm model's body (hidden states, not logits), checked on a probe input; a
    ``ValueError`` saying why where the model does not fit the contract. Causal: it
    needs no mask (the padding comes after every row's tokens)."""
    kind = type(model).__module__
    for name in _BODY_NAMES:
        body = getattr(model, name, None)
        if not isinstance(body, nn.Module):
            continue
        try:
            out = body(mx.array([[1, 2, 3]]))
        except TypeError:  # this attribute is not a body taking token ids alone
            continue
        shape = tuple(getattr(out, "shape", ()))
        size_ok = shape[-1:] != (vocab_size,) and (hidden_size is None or shape[-1] == hidden_size)
        if len(shape) == 3 and shape[:2] == (1, 3) and size_ok:
            return lambda ids, mask, body=body: body(ids)
    raise ValueError(
        f"{kind}: mlxd cannot embed with this model: none of its "
        f"{', '.join(_BODY_NAMES)} returns hidden states for token ids"
    )


def model_pooling(model_dir: Path) -> tuple[str | None, bool]:
    """The pooling (None: not said) and normalisation that the model's
    sentence-transformers files declare."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None, False
    modules = json.loads(modules_file.read_text())
    normalize = any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    for m in modules:
        if str(m.get("type", "")).endswith(".Pooling"):
            config_file = model_dir / m.get("path", "") / "config.json"
            if config_file.is_file():
                config = json.loads(config_file.read_text())
                modes = [mode for key, mode in _ST_POOLING.items() if config.get(key)]
                if len(modes) == 1:
                    return modes[0], normalize
    return None, normalize


def load_encoder(model_dir: Path, config: dict[str, Any]) -> tuple[Body, Any]:
    """An encoder (``ENCODERS``) through mlx-embeddings, and its tokenizer; a ``ValueError``
    saying why where the package is missing, untested, or its model breaks the contract."""
    try:
        version = metadata.version("mlx-embeddings")
        from mlx_embeddings.utils import load_model
    except (ImportError, metadata.PackageNotFoundError) as exc:
        raise ValueError(f"{config['model_type']} models need the mlx-embeddings package") from exc
    low, high = MLX_EMBEDDINGS_TESTED
    if not low <= tuple(int(p) for p in version.split(".")[:2]) < high:
        raise ValueError(f"mlx-embeddings {version} is untested: mlxd needs >=0.1, <0.2")
    from transformers import AutoTokenizer

    model = load_model(model_dir)  # a local directory: never the hub

    def body(ids: mx.array, mask: mx.array) -> mx.array:
        return model(ids, attention_mask=mask).last_hidden_state

    out = getattr(
        model(mx.array([[1, 2]]), attention_mask=mx.ones((1, 2))), "last_hidden_state", None
    )
    if out is None or tuple(out.shape[:2]) != (1, 2) or out.ndim != 3:
        raise ValueError(f"mlx-embeddings' {config['model_type']} model returns no hidden states")
    return body, AutoTokenizer.from_pretrained(str(model_dir))


def embedding_info(
    model_dir: Path,
    config: dict[str, Any],
    dimensions: int,
    context: int,
    o: EmbeddingOptions,
    backend: str = "mlx-lm",
) -> EmbeddingInfo:
    """The model's traits from its files and the entry's settings (which win)."""
    declared, _ = model_pooling(model_dir)
    fallback = "last" if backend == "mlx-lm" else "mean"  # a causal body's last token saw all
    pooling = o.pooling if o.pooling != "auto" else (declared or fallback)
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}, not {pooling!r}")
    sizes = o.matryoshka or tuple(config.get("matryoshka_dimensions") or ())
    bad = [d for d in sizes if not 1 <= d <= dimensions]
    if bad:
        raise ValueError(f"matryoshka dimensions {bad} are not within 1..{dimensions}")
    max_tokens = min(o.max_input_tokens, context) if o.max_input_tokens else context
    return EmbeddingInfo(
        dimensions=dimensions,
        pooling=pooling,  # type: ignore[arg-type]
        normalize=o.normalize,
        matryoshka=tuple(sorted(set(sizes))),
        max_tokens=max_tokens,
        backend=backend,
    )


def embedding_runner(
    body: Body,
    config: dict[str, Any],
    model_dir: Path,
    context: int,
    vocab: int,
    o: EmbeddingOptions,
    backend: str = "mlx-lm",
) -> EmbeddingRunner:
    """The runner for a loaded model's body (engine thread), its traits logged."""
    dimensions = int(body(mx.array([[1]]), mx.ones((1, 1))).shape[-1])
    info = embedding_info(model_dir, config, dimensions, context, o, backend)
    pad = config.get("pad_token_id")
    log.info(
        "embedding model (%s): %d dimensions, %s pooling%s, inputs up to %d tokens%s",
        backend,
        info.dimensions,
        info.pooling,
        ", normalised" if info.normalize else "",
        info.max_tokens,
        f", matryoshka sizes {list(info.matryoshka)}" if info.matryoshka else "",
    )
    pad_id = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    return EmbeddingRunner(body, info, o, pad_id)
