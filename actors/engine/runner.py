"""Runs MLX model code: mlx-lm behind a small runner protocol (``vlm_runner`` adds mlx-vlm).

``MlxRunner`` prefills each request on its own prompt cache (so a failure is
that request's alone, and long prompts go a chunk per engine step), then hands
the cache to mlx-lm's ``BatchGenerator`` with ``insert(..., caches=...)``; every
``decode()`` is one ``BatchGenerator.next()``. Any per-layer mix of cache kinds
(attention, sliding window, SSM state, cache lists) works: ``caches`` checks at
start-up that every layer can be batched. All methods must be called on the
generation actor's thread: MLX streams are thread-local.
"""

from __future__ import annotations

import copy
import ctypes
import ctypes.util
import dataclasses
import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
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

from actors.engine import caches
from actors.engine.caches import check_batchable, layer_kinds
from actors.engine.guards import RowGuard, bias_processor
from actors.engine.logits import GrammarProcessor, token_logprobs
from actors.engine.memory import AttentionLayer, Layer, MemoryModel, StateLayer, kv_budget
from actors.engine.prefix_cache import PrefixCache
from actors.engine.types import Decoded, ModelInfo, model_kind
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
    """A bounds-checked bias, penalties from mlx-lm; a grammar mask last, so nothing can undo it."""
    processors = [bias_processor(params.logit_bias)] if params.logit_bias else []
    processors += make_logits_processors(
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
    return dequantize_for_cpu(model, config, dequantize_on_cpu), tokenizer, config


@dataclass
class Pending:
    """A request being prefilled on its own cache."""

    request: TokenizedRequest
    cache: list[Any] = field(default_factory=list)
    done: int = 0  # prompt tokens already in the cache
    inputs: Any = None  # runner-specific prepared inputs (a VLM's prompt embeddings)
    checkpoints: list[int] = field(default_factory=list)  # where to snapshot, ascending
    sparse: Any = None  # a SpecPrefill ``SparsePlan``: only its kept chunks are prefilled

    @property
    def remaining(self) -> int:
        if self.sparse is not None:
            return self.sparse.remaining
        return len(self.request.prompt_tokens) - 1 - self.done

    def next_stop(self, budget: int) -> int:
        """Tokens to prefill now: the budget, cut at the next checkpoint."""
        n = min(budget, self.remaining)
        ahead = [c - self.done for c in self.checkpoints if c > self.done]
        return min([n, *ahead])


class MlxRunner:
    """Per-request chunked prefill, then continuous batched decode in mlx-lm."""

    def __init__(
        self,
        model: nn.Module,
        stop_tokens: list[int],
        max_batch: int,
        *,
        make_cache: Callable[[], list[Any]] | None = None,
        decode_model: Callable[..., mx.array] | None = None,
        prefix_cache: PrefixCache | None = None,
        spec_prefill: Any = None,
    ):
        self.model = model
        self.prefix_cache = prefix_cache
        self.spec_prefill = spec_prefill  # a ``spec_prefill.SpecPrefill`` (None: off)
        self._sparse: set[str] = set()  # requests sparse-prefilled: never remembered
        self._make_cache = make_cache or (lambda: make_prompt_cache(model))
        cache = self._make_cache()
        check_batchable(cache, self._make_cache())
        log.info("per-layer caches: %s", layer_kinds(cache))
        self._decode_model = decode_model or model
        self._stop_tokens = [[t] for t in stop_tokens]
        self._max_batch = max_batch
        self._stream = mx.new_stream(mx.default_device())
        self.generator = self._new_generator()
        self._pending: dict[str, Pending] = {}
        self._uid_to_rid: dict[int, str] = {}
        self._rid_to_uid: dict[str, int] = {}
        self._top: dict[str, int] = {}  # requests that want logprobs → how many alternatives
        self._guard = RowGuard()

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._decode_model,
            stop_tokens=self._stop_tokens,
            completion_batch_size=self._max_batch,
            prefill_batch_size=self._max_batch,
            stream=self._stream,
        )

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

    def start(self, request: TokenizedRequest) -> int:
        """Set up the request's cache (from the prefix cache if it can); return tokens reused."""
        prompt = request.prompt_tokens
        cache, done = self._cached(prompt)
        marks = sorted(c for c in request.checkpoints if done < c < len(prompt) - 1)
        pending = Pending(request, cache, done, checkpoints=marks)
        if self.spec_prefill is not None:
            pending.sparse = self.spec_prefill.plan(prompt, done, request.sampling.spec_prefill)
        if pending.sparse is not None:
            from actors.engine.spec_prefill import positioned

            pending.cache, pending.checkpoints = positioned(cache), []
            self._sparse.add(request.request_id)
        self._pending[request.request_id] = pending
        return done

    def skipped_tokens(self, request_id: str) -> int:
        """Prompt tokens SpecPrefill will not prefill for this request (0: a full prefill)."""
        pending = self._pending.get(request_id)
        return pending.sparse.skipped if pending is not None and pending.sparse else 0

    def _cached(self, prompt: tuple[int, ...]) -> tuple[list[Any], int]:
        hit = self.prefix_cache.lookup(prompt, len(prompt) - 1) if self.prefix_cache else None
        if hit is None:
            return self._make_cache(), 0
        # New cache objects over the same (immutable) buffers: never share a snapshot.
        cache = copy.deepcopy(hit.entry.snapshot)
        caches.trim(cache, len(hit.entry.tokens) - hit.length)
        return cache, hit.length

    def _remember(
        self, tokens: list[int] | tuple[int, ...], cache: list[Any], *, live: bool = False
    ) -> None:
        """Offer a snapshot to the prefix cache, in buffers of its own.

        ``live``: the cache is still in use, so the snapshot is taken from a copy.
        """
        if self.prefix_cache is not None and tokens and tokens not in self.prefix_cache:
            snapshot = caches.compact(copy.deepcopy(cache) if live else cache)
            mx.eval([c.state for c in snapshot])
            self.prefix_cache.insert(
                tokens, snapshot, caches.nbytes(snapshot), caches.can_trim(snapshot)
            )

    def prefill(self, request_id: str, budget: int) -> int:
        """Prefill up to ``budget`` prompt tokens; return how many are left (0: decoding)."""
        pending = self._pending[request_id]
        if pending.sparse is not None:
            with mx.stream(self._stream):
                self.spec_prefill.step(self.model, pending.cache, pending.sparse, budget)
                mx.eval([c.state for c in pending.cache])
            if pending.remaining == 0:
                self._join_batch(self._pending.pop(request_id))
            return pending.remaining
        n = pending.next_stop(budget)
        if n > 0:
            with mx.stream(self._stream):
                self._prefill_chunk(pending, n)
                mx.eval([c.state for c in pending.cache])
            pending.done += n
            if pending.done in pending.checkpoints:
                prefix = pending.request.prompt_tokens[: pending.done]
                self._remember(prefix, pending.cache, live=True)
        if pending.remaining == 0:
            self._join_batch(self._pending.pop(request_id))
        return pending.remaining

    def _prefill_chunk(self, pending: Pending, n: int) -> None:
        chunk = pending.request.prompt_tokens[pending.done : pending.done + n]
        self.model(mx.array(chunk)[None], cache=pending.cache)

    def _batch_cache(self, pending: Pending) -> list[Any]:
        """The cache list that joins the batch (a VLM appends per-sequence state)."""
        return pending.cache

    def _joining(self, pending: Pending) -> list[Any]:
        """The prefilled cache, remembered if it is a full prefill; with SpecPrefill on, its
        attention layers positioned (so every cache merged into a batch carries positions)."""
        prompt = pending.request.prompt_tokens
        if pending.sparse is None:
            self._remember(prompt[:-1], pending.cache, live=True)
        if self.spec_prefill is None:
            return pending.cache
        from actors.engine.spec_prefill import positioned, set_position

        cache = positioned(pending.cache)
        set_position(cache, len(prompt) - 1)
        return cache

    def _join_batch(self, pending: Pending) -> None:
        request = pending.request
        params = request.sampling
        pending.cache = self._joining(pending)
        (uid,) = self.generator.insert(
            [[request.prompt_tokens[-1]]],
            max_tokens=[params.max_tokens],
            caches=[self._batch_cache(pending)],
            all_tokens=[list(request.prompt_tokens[:-1])],
            samplers=[self._guarded_sampler(request)],
            logits_processors=[self._guarded_processors(request)],
        )
        self._uid_to_rid[uid] = request.request_id
        self._rid_to_uid[request.request_id] = uid
        if params.logprobs:
            self._top[request.request_id] = params.top_logprobs

    def _guarded_sampler(self, request: TokenizedRequest):
        """The request's sampler; one that can fail is guarded (greedy stays the shared object,
        so an all-greedy batch still samples in one call)."""
        sample = make_sampler(request.sampling)
        if sample is greedy_sampler:
            return sample
        return self._guard.sampler(request.request_id, sample)

    def _guarded_processors(self, request: TokenizedRequest) -> list:
        processors = make_processors(request.sampling, request.grammar)
        return [self._guard.processor(request.request_id, p) for p in processors]

    def faults(self) -> dict[str, Exception]:
        return self._guard.take()

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
                self._remember_finished(rid, r.all_tokens, r.prompt_cache)  # a fresh copy
                self._top.pop(rid, None)
        return out

    def _remember_finished(
        self, request_id: str, tokens: Any, cache: Any, *, live: bool = False
    ) -> None:
        """A finished request's cache, unless SpecPrefill skipped part of its prompt."""
        if request_id in self._sparse:
            self._sparse.discard(request_id)
        else:
            self._remember(tokens, cache, live=live)

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
            for cache, tokens in self.generator.remove([uid], return_prompt_caches=True).values():
                self._remember_finished(request_id, tokens, cache, live=True)
        self._sparse.discard(request_id)

    def clear_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def reset(self) -> None:
        """After a failed decode step: a fresh batch (the old one may be half-updated)."""
        self.generator.close()
        self.generator = self._new_generator()
        self._uid_to_rid.clear()
        self._rid_to_uid.clear()
        self._sparse.intersection_update(self._pending)
        self._guard.take()
        mx.clear_cache()

    def memory_stats(self) -> tuple[int, int]:
        return mx.get_active_memory(), mx.get_peak_memory()

    def release_buffers(self) -> None:
        """The engine is idle: hand MLX's cached free buffers back to the system."""
        mx.clear_cache()
        _trim_heap()

    def _probe(self, cache: list[Any]) -> None:
        self.model(mx.array([[0]]), cache=cache)

    def probe_layers(self) -> tuple[Layer, ...]:
        """Measure each layer's cache on a one-token forward pass: per-token KV or fixed state."""
        cache = self._make_cache()
        with mx.stream(self._stream):
            self._probe(cache)
            mx.eval([c.state for c in cache])
        layers = tuple(_layer_of(c) for c in _leaf_caches(cache))
        del cache
        mx.clear_cache()
        return layers


def _libc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, where the C library has it (Linux; not macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return functools.partial(libc.malloc_trim, 0)
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def _trim_heap() -> None:
    """Give freed heap pages back to the system. On the CPU backend MLX's buffers come
    from malloc, and glibc keeps large freed chunks in its arenas (its mmap threshold
    rises as they are freed): without this, resident memory stays near the burst's peak."""
    if _TRIM is not None:
        _TRIM()


def _leaf_caches(caches) -> list[Any]:
    out = []
    for c in caches:
        out.extend(_leaf_caches(c.caches) if hasattr(c, "caches") else [c])
    return out


def _layer_of(cache: Any) -> Layer:
    """A cache with keys grows per token (its third axis is the allocated length)."""
    keys = getattr(cache, "keys", None)
    if keys is None:
        return StateLayer(state_bytes=int(cache.nbytes))
    arrays = [a for _, a in tree_flatten((cache.keys, cache.values))]
    per_token = sum(a.nbytes // a.shape[2] for a in arrays)
    return AttentionLayer(bytes_per_token=int(per_token), window=getattr(cache, "max_size", None))


def device_memory_bytes() -> int:
    """Memory MLX may use: Metal's recommended working set, the GPU's memory, or system RAM."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_model(runner: MlxRunner, settings: Any) -> MemoryModel | None:
    """Probe the model's caches, size the request budget, and set MLX's memory limit."""
    if settings is None:
        return None
    device = device_memory_bytes()
    weights = mx.get_active_memory()
    budget = kv_budget(
        device_bytes=device,
        weights_bytes=weights,
        fraction=settings.device_fraction,
        headroom_bytes=settings.headroom_mb << 20,
        explicit_bytes=settings.kv_budget_mb << 20,
    )
    if settings.set_mlx_limit:
        mx.set_memory_limit(int(device * settings.device_fraction))
    # Freed buffers MLX keeps for reuse; the rest go back to the system (and all of
    # them whenever the engine goes idle, ``release_buffers``).
    mx.set_cache_limit(settings.cache_limit_mb << 20)
    model = MemoryModel(layers=runner.probe_layers(), budget_bytes=budget)
    log.info(
        "memory: %.0f MiB device, %.0f MiB weights, %.0f MiB for requests "
        "(%d KV bytes per token, %d bytes of fixed state per request)",
        device / 2**20,
        weights / 2**20,
        budget / 2**20,
        model.kv_bytes_per_token,
        model.state_bytes,
    )
    return model


def resolve_model_dir(path: str, cache_dir: Path, progress) -> tuple[str, Path]:
    """A model directory as given, or a GGUF file converted (and cached) into one."""
    from actors.engine.gguf import convert_gguf, default_model_path

    source = Path(path).expanduser() if path else default_model_path()
    if not source.exists():
        raise FileNotFoundError(f"model not found: {source}")
    if source.suffix == ".gguf":
        return source.stem, convert_gguf(source, cache_dir, progress)
    return source.name, source


def config_value(config: dict[str, Any], key: str, default: Any = None) -> Any:
    """A setting from the model's config, at the top level or in its ``text_config``."""
    if config.get(key) is not None:
        return config[key]
    return config.get("text_config", {}).get(key, default)


def dequantize_for_cpu(model: nn.Module, config: dict[str, Any], enabled: bool) -> nn.Module:
    if enabled and backend() == "cpu" and "quantization" in config:
        log.info("CPU backend: dequantizing weights to float32 (model.dequantize_on_cpu)")
        model = dequantize_model(model)
        model.set_dtype(mx.float32)
        mx.eval(model.parameters())
    return model


def make_prefix_cache(settings: Any) -> PrefixCache | None:
    if settings is None or not settings.enabled:
        return None
    budget = settings.max_bytes or int(device_memory_bytes() * settings.memory_fraction)
    log.info("prefix cache: %.0f MiB budget, %d-token blocks", budget / 2**20, settings.block_size)
    return PrefixCache(block_size=settings.block_size, max_bytes=budget)


def _off(reason: str) -> Any:
    from actors.engine.speculative import SpecStats

    return SpecStats(notes=[f"off: {reason}"])


def _prefill_off(reason: str) -> Any:
    from actors.engine.spec_prefill import SpecPrefillStats

    return SpecPrefillStats(enabled=False, notes=[f"off: {reason}"])


def make_spec_prefill(model: nn.Module, scorer: tuple[nn.Module, str], settings: Any) -> Any:
    """SpecPrefill for this model, or (its stats saying why) off for its cache layout."""
    from actors.engine.spec_prefill import SpecPrefill, SpecPrefillStats, unsupported_layers

    stats = SpecPrefillStats(scorer=scorer[1])
    why = unsupported_layers(make_prompt_cache(model), settings.hybrid)
    if why is not None:
        log.warning("SpecPrefill is off for this model: %s", why)
        stats.enabled, stats.notes = False, [f"off: {why}"]
    elif any(not hasattr(c, "keys") for c in make_prompt_cache(model)):
        stats.notes.append("hybrid model: SSM layers see only the kept tokens")
    return SpecPrefill(scorer[0], settings, stats)


def load_draft(
    path: str, cache_dir: Path, model: nn.Module, model_id: str, dequantize_on_cpu: bool
) -> tuple[nn.Module, str]:
    """The draft model and its name; "" means the served model drafts for itself."""
    if not path:
        return model, f"{model_id} (self)"
    draft_id, draft_dir = resolve_model_dir(path, cache_dir, log.info)
    log.info("loading draft model %s from %s", draft_id, draft_dir)
    return load_model(draft_dir, dequantize_on_cpu=dequantize_on_cpu)[0], draft_id


def _enabled(section: Any) -> bool:
    return section is not None and section.enabled


def _load_vision(
    model_id: str, model_dir: Path, max_batch: int, dequantize_on_cpu: bool, extras: dict
) -> tuple[MlxRunner, ModelInfo]:
    """A vision model: MTP speculation for text-only requests when its text backbone has a
    head; no draft-model speculation or SpecPrefill yet, and the status says so."""
    from actors.engine.vlm_runner import load_vlm_runner

    runner, info = load_vlm_runner(
        model_id, model_dir, max_batch=max_batch, dequantize_on_cpu=dequantize_on_cpu
    )
    speculative = extras["speculative"]
    if _enabled(speculative):
        runner, stats = _vision_speculation(runner, model_dir, speculative, dequantize_on_cpu)
        info = dataclasses.replace(info, spec_stats=stats)
    info = dataclasses.replace(info, memory=memory_model(runner, extras["memory"]))
    if _enabled(extras["spec_prefill"]):
        log.warning("SpecPrefill is not implemented for vision models: off")
        info = dataclasses.replace(
            info, spec_prefill_stats=_prefill_off("vision models prefill in full")
        )
    return runner, info


def _vision_speculation(runner, model_dir: Path, speculative: Any, dequantize_on_cpu: bool):
    """The runner and its speculation stats: MTP for text-only requests, or off and why."""
    from actors.engine.speculative import UnsupportedForSpeculation
    from actors.engine.vlm_mtp import VlmMtpRunner

    if speculative.drafter == "draft_model":
        log.warning("draft-model speculation is not implemented for vision models: off")
        return runner, _off("vision models speculate only with an MTP head (drafter = mtp)")
    config = json.loads((model_dir / "config.json").read_text())
    try:
        drafter = load_mtp_drafter(runner.model, model_dir, config, dequantize_on_cpu)
        mtp = VlmMtpRunner(
            runner.model,
            [t for (t,) in runner._stop_tokens],
            runner._max_batch,
            drafter=drafter,
            num_draft=speculative.num_draft_tokens,
            spec_max_batch=speculative.max_batch,
        )
    except (ValueError, UnsupportedForSpeculation) as exc:
        log.warning("speculative decoding is off for this vision model: %s", exc)
        return runner, _off(f"vision model: {exc}")
    return mtp, mtp.spec_stats


def load_mtp_drafter(model: nn.Module, model_dir: Path, config: dict, dequantize_on_cpu: bool):
    """The model's own MTP head as a drafter; ``ValueError`` saying why it has none."""
    from actors.engine.mtp import MTPDrafter, load_mtp

    head = dequantize_for_cpu(load_mtp(model_dir, config), config, dequantize_on_cpu)
    log.info("speculative decoding: drafting with the model's MTP head")
    return MTPDrafter(head, model, name="mtp")


def _helpers(model, model_id, cache_dir, dequantize_on_cpu, speculative, spec_prefill, where):
    """The drafter (speculation) and the SpecPrefill scorer, sharing one load when they can.

    ``where``: the model's directory and config (an MTP head is read from there).
    """
    draft, drafter, off = None, "", None
    if _enabled(speculative) and speculative.drafter in ("auto", "mtp"):
        try:
            draft = load_mtp_drafter(model, *where, dequantize_on_cpu)
            drafter = draft.name
        except ValueError as exc:
            if speculative.drafter == "mtp":
                log.warning("speculative decoding is off: %s", exc)
                off = _off(f"drafter = mtp: {exc}")
    if _enabled(speculative) and draft is None and off is None:
        draft, drafter = load_draft(
            speculative.draft_model, cache_dir, model, model_id, dequantize_on_cpu
        )
    sparse = None
    if _enabled(spec_prefill):
        usable = draft is not None and isinstance(draft, nn.Module)  # an MTP head cannot score
        scorer = (draft, drafter) if usable and not spec_prefill.scorer_model else None
        scorer = scorer or load_draft(
            spec_prefill.scorer_model, cache_dir, model, model_id, dequantize_on_cpu
        )
        sparse = make_spec_prefill(model, scorer, spec_prefill)
    return draft, drafter, sparse, off


def load_runner(
    path: str,
    cache_dir: Path,
    *,
    dequantize_on_cpu: bool,
    max_batch: int,
    kind: str = "auto",
    prefix_cache: Any = None,
    memory: Any = None,
    speculative: Any = None,
    spec_prefill: Any = None,
) -> tuple[MlxRunner, ModelInfo]:
    """Load the model for serving; call on the generation thread.

    The kind (text or vision) comes from the model's config unless ``kind`` names it.
    ``memory`` (the ``[memory]`` settings) turns on the memory estimate and budget;
    without it the engine has no memory gate.
    """
    model_id, model_dir = resolve_model_dir(path, cache_dir, log.info)
    config = json.loads((model_dir / "config.json").read_text())
    kind = model_kind(config, kind)
    log.info("loading %s model %s from %s (MLX backend: %s)", kind, model_id, model_dir, backend())
    if kind == "vision":
        extras = {"memory": memory, "speculative": speculative, "spec_prefill": spec_prefill}
        return _load_vision(model_id, model_dir, max_batch, dequantize_on_cpu, extras)
    model, tokenizer, config = load_model(model_dir, dequantize_on_cpu=dequantize_on_cpu)
    info = ModelInfo(
        model_id=model_id,
        model_dir=model_dir,
        context_length=int(config_value(config, "max_position_embeddings", 4096)),
        vocab_size=int(config_value(config, "vocab_size") or len(tokenizer.vocab)),
        tokenizer=tokenizer,
        backend=backend(),
    )
    cache = make_prefix_cache(prefix_cache)
    stops = sorted(tokenizer.eos_token_ids)
    where = (model_dir, config)
    helpers = (model, model_id, cache_dir, dequantize_on_cpu, speculative, spec_prefill, where)
    draft, drafter, sparse, off = _helpers(*helpers)
    on = sparse if sparse is not None and sparse.stats.enabled else None
    runner: MlxRunner
    if draft is not None:
        from actors.engine.spec_runner import make_speculative_runner

        runner = make_speculative_runner(
            model, draft, stops, max_batch, speculative, cache, drafter, spec_prefill=on
        )
    else:
        runner = MlxRunner(model, stops, max_batch, prefix_cache=cache, spec_prefill=on)
    return runner, dataclasses.replace(
        info,
        cache_stats=cache.stats if cache else None,
        spec_stats=getattr(runner, "spec_stats", off),
        spec_prefill_stats=sparse.stats if sparse is not None else None,
        memory=memory_model(runner, memory),
    )
