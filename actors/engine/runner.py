"""The only module that runs MLX model code: mlx-lm behind a small runner protocol.

``MlxRunner`` prefills each request on its own prompt cache (so a failure is
that request's alone, and long prompts go a chunk per engine step), then hands
the cache to mlx-lm's ``BatchGenerator`` with ``insert(..., caches=...)``; every
``decode()`` is one ``BatchGenerator.next()``. All methods must be called on the
generation actor's thread: MLX streams are thread-local.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load as mlx_lm_load

from actors.engine.logits import GrammarProcessor, token_logprobs
from actors.engine.types import Decoded, ModelInfo
from actors.grammar import CompiledGrammar
from protocol.messages import SamplingParams, TokenizedRequest

log = logging.getLogger("mlxd.runner")

# Penalties look back over the whole sequence, as the OpenAI API defines them.
_PENALTY_CONTEXT = 1 << 20


def make_sampler(params: SamplingParams):
    """A per-request sampler; a seeded one draws from its own key, not the global RNG."""
    if params.greedy:
        return greedy_sampler  # shared object: an all-greedy batch samples in one call
    key = [mx.random.key(params.seed)] if params.seed is not None else None

    def sample(logprobs: mx.array) -> mx.array:
        if 0.0 < params.top_p < 1.0:
            logprobs = apply_top_p(logprobs, params.top_p)
        if params.min_p > 0.0:
            logprobs = apply_min_p(logprobs, params.min_p)
        if params.top_k > 0:
            logprobs = apply_top_k(logprobs, params.top_k)
        scaled = logprobs * (1.0 / params.temperature)
        if key is None:
            return mx.random.categorical(scaled)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(scaled, key=sub)

    return sample


def make_processors(params: SamplingParams, grammar: object | None = None) -> list:
    """Penalties and bias from mlx-lm; a grammar mask last, so nothing can undo it."""
    processors = make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=_PENALTY_CONTEXT,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=_PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=_PENALTY_CONTEXT,
    )
    if isinstance(grammar, CompiledGrammar):
        processors.append(GrammarProcessor(grammar))
    return processors


def backend() -> str:
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def load_model(model_dir: Path, *, dequantize_on_cpu: bool) -> tuple[nn.Module, Any, dict]:
    """Load an mlx-lm model directory; on the CPU backend optionally as float32."""
    model, tokenizer, config = mlx_lm_load(str(model_dir), return_config=True)
    if dequantize_on_cpu and backend() == "cpu" and "quantization" in config:
        log.info("CPU backend: dequantizing weights to float32 (model.dequantize_on_cpu)")
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    return model, tokenizer, config


@dataclass
class _Pending:
    """A request being prefilled on its own cache."""

    request: TokenizedRequest
    cache: list[Any] = field(default_factory=list)
    done: int = 0  # prompt tokens already in the cache

    @property
    def remaining(self) -> int:
        return len(self.request.prompt_tokens) - 1 - self.done


class MlxRunner:
    """Per-request chunked prefill, then continuous batched decode in mlx-lm."""

    def __init__(self, model: nn.Module, stop_tokens: list[int], max_batch: int):
        self.model = model
        self._stream = mx.new_stream(mx.default_device())
        self.generator = BatchGenerator(
            model,
            stop_tokens=[[t] for t in stop_tokens],
            completion_batch_size=max_batch,
            prefill_batch_size=max_batch,
            stream=self._stream,
        )
        self._pending: dict[str, _Pending] = {}
        self._uid_to_rid: dict[int, str] = {}
        self._rid_to_uid: dict[str, int] = {}
        self._top: dict[str, int] = {}  # requests that want logprobs → how many alternatives

    @property
    def decoding(self) -> int:
        return len(self._rid_to_uid)

    @property
    def prefilling_count(self) -> int:
        return len(self._pending)

    @property
    def cache_bytes(self) -> int:
        """Bytes of KV state held for requests: 0 when nothing runs."""
        pending = sum(c.nbytes for p in self._pending.values() for c in p.cache)
        return pending + self.generator.prompt_cache_nbytes

    def start(self, request: TokenizedRequest) -> None:
        self._pending[request.request_id] = _Pending(request, make_prompt_cache(self.model))

    def prefill(self, request_id: str, budget: int) -> int:
        """Prefill up to ``budget`` prompt tokens; return how many are left (0: decoding)."""
        pending = self._pending[request_id]
        n = min(budget, pending.remaining)
        if n > 0:
            chunk = pending.request.prompt_tokens[pending.done : pending.done + n]
            with mx.stream(self._stream):
                self.model(mx.array(chunk)[None], cache=pending.cache)
                mx.eval([c.state for c in pending.cache])
            pending.done += n
        if pending.remaining == 0:
            self._join_batch(self._pending.pop(request_id))
        return pending.remaining

    def _join_batch(self, pending: _Pending) -> None:
        request = pending.request
        params = request.sampling
        (uid,) = self.generator.insert(
            [[request.prompt_tokens[-1]]],
            max_tokens=[params.max_tokens],
            caches=[pending.cache],
            all_tokens=[list(request.prompt_tokens[:-1])],
            samplers=[make_sampler(params)],
            logits_processors=[make_processors(params, request.grammar)],
        )
        self._uid_to_rid[uid] = request.request_id
        self._rid_to_uid[request.request_id] = uid
        if params.logprobs:
            self._top[request.request_id] = params.top_logprobs

    def decode(self) -> list[Decoded]:
        if not self._rid_to_uid:
            return []
        _, responses = self.generator.next()
        logprobs = self._logprobs(responses)
        out = []
        for r in responses:
            rid = self._uid_to_rid[r.uid]
            out.append(Decoded(rid, r.token, r.finish_reason, logprobs.get(r.uid)))
            if r.finish_reason is not None:
                del self._uid_to_rid[r.uid], self._rid_to_uid[rid]
                self._top.pop(rid, None)
        return out

    def _logprobs(self, responses: list) -> dict:
        """Logprobs for the responses whose requests asked, in one batched computation."""
        want = [r for r in responses if self._uid_to_rid[r.uid] in self._top]
        if not want:
            return {}
        tops = [self._top[self._uid_to_rid[r.uid]] for r in want]
        found = token_logprobs([r.logprobs for r in want], [r.token for r in want], tops)
        return {r.uid: lp for r, lp in zip(want, found, strict=True)}

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._top.pop(request_id, None)
        uid = self._rid_to_uid.pop(request_id, None)
        if uid is not None:
            del self._uid_to_rid[uid]
            self.generator.remove([uid])


def resolve_model_dir(path: str, cache_dir: Path, progress) -> tuple[str, Path]:
    """A model directory as given, or a GGUF file converted (and cached) into one."""
    from actors.engine.gguf import convert_gguf, default_model_path

    source = Path(path).expanduser() if path else default_model_path()
    if not source.exists():
        raise FileNotFoundError(f"model not found: {source}")
    if source.suffix == ".gguf":
        return source.stem, convert_gguf(source, cache_dir, progress)
    return source.name, source


def load_runner(
    path: str, cache_dir: Path, *, dequantize_on_cpu: bool, max_batch: int
) -> tuple[MlxRunner, ModelInfo]:
    """Load the model for serving; call on the generation thread."""
    model_id, model_dir = resolve_model_dir(path, cache_dir, log.info)
    log.info("loading %s from %s (MLX backend: %s)", model_id, model_dir, backend())
    model, tokenizer, config = load_model(model_dir, dequantize_on_cpu=dequantize_on_cpu)
    context = config.get("max_position_embeddings") or config.get("text_config", {}).get(
        "max_position_embeddings", 4096
    )
    info = ModelInfo(
        model_id=model_id,
        model_dir=model_dir,
        context_length=int(context),
        vocab_size=int(config.get("vocab_size") or len(tokenizer.vocab)),
        tokenizer=tokenizer,
        backend=backend(),
    )
    runner = MlxRunner(model, sorted(tokenizer.eos_token_ids), max_batch)
    return runner, info
