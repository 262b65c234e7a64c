"""The engine's composition root: loads a model and picks the runner that serves it.

The only module that imports the runner variants: a text model gets the plain
``MlxRunner`` or, with speculation on, a ``SpeculativeRunner`` drafting with the
model's MTP head, a draft model or prompt lookup; a vision model gets a ``VlmRunner``, or a
``VlmMtpRunner`` when its text backbone has an MTP head. Around the runner it
builds the prefix cache, SpecPrefill (with its scorer), and the memory model. Call
``load_runner`` on the generation thread: MLX streams are thread-local.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load as mlx_lm_load
from mlxd.actors.engine import backend_policy
from mlxd.actors.engine.adapters import multi_lora
from mlxd.actors.engine.adapters.bank import AdapterBank
from mlxd.actors.engine.kernels import linear_attention
from mlxd.actors.engine.loading.gguf.convert import (
    convert_gguf,
    default_model_path,
    storage_for_backend,
)
from mlxd.actors.engine.loading.gguf.tensors import Storage
from mlxd.actors.engine.loading.sources import hub_snapshot, model_source
from mlxd.actors.engine.runner import disk_codec
from mlxd.actors.engine.runner.base import MlxRunner
from mlxd.actors.engine.runner.disk_tier import adapter_slug
from mlxd.actors.engine.runner.embedding import (
    ENCODERS,
    EmbeddingRunner,
    embedding_runner,
    find_body,
    load_encoder,
)
from mlxd.actors.engine.runner.prefix_cache import PrefixCache
from mlxd.actors.engine.runner.vlm import VlmRunner
from mlxd.actors.engine.scheduler.memory import MemoryModel, kv_budget
from mlxd.actors.engine.scheduler.options import (
    LoadOptions,
    MemoryOptions,
    PrefixCacheOptions,
    SpecPrefillOptions,
    SpeculativeOptions,
)
from mlxd.actors.engine.scheduler.types import ModelInfo, model_kind
from mlxd.actors.engine.speculative.batch import UnsupportedForSpeculation
from mlxd.actors.engine.speculative.lookup import LookupDrafter
from mlxd.actors.engine.speculative.mtp import MTPDrafter, load_mtp
from mlxd.actors.engine.speculative.runner import make_speculative_runner
from mlxd.actors.engine.speculative.spec_prefill import SpecPrefill, unsupported_layers
from mlxd.actors.engine.speculative.vlm_mtp import VlmMtpRunner
from mlxd.actors.families import fallback_templates
from mlxd.protocol.messages import SpecPrefillCounters, SpeculativeCounters

log = logging.getLogger("mlxd.runner")


def backend() -> str:
    """metal, cuda or cpu: the row of the backend table (``backend_policy``) that applies."""
    return backend_policy.detect()


Shard = Callable[[nn.Module, dict], None]


def load_model(
    model_dir: Path,
    *,
    dequantize_on_cpu: bool,
    shard: Shard | None = None,
    adapter_path: Path | None = None,
) -> tuple[nn.Module, Any, dict]:
    """Load an mlx-lm model directory; on the CPU backend optionally as float32.

    ``shard`` splits the model over a distributed group (``replica.py``) while its
    weights are still lazy, so each rank reads only its own part of them.
    ``adapter_path``: an mlx-lm adapter directory (``adapter_config.json`` +
    ``adapters.safetensors``) whose LoRA / DoRA layers mlx-lm applies at load."""
    if adapter_path is not None:
        check_adapter(adapter_path)
    model, tokenizer, config = mlx_lm_load(
        str(model_dir),
        return_config=True,
        lazy=shard is not None,
        adapter_path=str(adapter_path) if adapter_path is not None else None,
    )
    if shard is not None:
        shard(model, config)
        mx.eval(model.parameters())
    return dequantize_for_cpu(model, config, dequantize_on_cpu), tokenizer, config


def check_adapter(adapter_path: Path) -> None:
    """An adapter directory mlx-lm can read, else a ``FileNotFoundError`` naming the file."""
    for name in ("adapter_config.json", "adapters.safetensors"):
        if not (adapter_path / name).is_file():
            raise FileNotFoundError(f"LoRA adapter {adapter_path}: {name} not found")


def device_memory_bytes() -> int:
    """Memory MLX may use: Metal's recommended working set, the GPU's memory, or system RAM."""
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_model(runner: MlxRunner, options: MemoryOptions | None) -> MemoryModel | None:
    """Probe the model's caches, size the request budget, and set MLX's memory limit."""
    if options is None:
        return None
    device = device_memory_bytes()
    weights = mx.get_active_memory()
    budget = kv_budget(
        device_bytes=device,
        weights_bytes=weights,
        fraction=options.device_fraction,
        headroom_bytes=options.headroom_mb << 20,
        explicit_bytes=options.kv_budget_mb << 20,
    )
    if options.set_mlx_limit:
        mx.set_memory_limit(int(device * options.device_fraction))
    # Freed buffers MLX keeps for reuse; the rest go back to the system (and all of
    # them whenever the engine goes idle, ``release_buffers``).
    mx.set_cache_limit(options.cache_limit_mb << 20)
    model = MemoryModel(
        layers=runner.probe_layers(),
        budget_bytes=budget,
        admission=options.admission,
        reserve_tokens=options.decode_reserve_tokens,
    )
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


def gguf_storage(dequantize_on_cpu: bool) -> Storage:
    """How a GGUF file's weights are stored: the backend's way, except that on the CPU
    backend ``model.dequantize_on_cpu = false`` keeps them affine-quantized (float32
    scales: float16 ones make MLX's CPU quantized matmul much slower still)."""
    if backend() == "cpu" and not dequantize_on_cpu:
        return Storage("affine", mx.float32)
    return storage_for_backend()


def resolve_model_dir(
    path: str, cache_dir: Path, progress, *, dequantize_on_cpu: bool = True
) -> tuple[str, Path]:
    """The model's id and directory: a local directory as given, a GGUF file converted (and
    cached) into one, or a Hugging Face Hub id (``ORG/NAME[@revision]``) from its cache."""
    source = model_source(path) if path else model_source(str(default_model_path()))
    match source.kind:
        case "local":
            return source.path.name, source.path
        case "gguf":
            storage = gguf_storage(dequantize_on_cpu)
            return source.path.stem, convert_gguf(source.path, cache_dir, progress, storage=storage)
        case "hub":
            return source.repo, hub_snapshot(source, progress)
    raise FileNotFoundError(
        f"model not found: {path} (not a local directory, .gguf file or Hugging Face id ORG/NAME)"
    )


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


def make_prefix_cache(options: PrefixCacheOptions | None) -> PrefixCache | None:
    if options is None:
        return None
    budget = options.max_bytes or int(device_memory_bytes() * options.memory_fraction)
    log.info("prefix cache: %.0f MiB budget, %d-token blocks", budget / 2**20, options.block_size)
    return PrefixCache(
        block_size=options.block_size, max_bytes=budget, affinity_keys=options.affinity_keys
    )


def _off(reason: str) -> SpeculativeCounters:
    return SpeculativeCounters(enabled=False, notes=(f"off: {reason}",))


def _prefill_off(reason: str) -> SpecPrefillCounters:
    return SpecPrefillCounters(enabled=False, notes=(f"off: {reason}",))


def make_spec_prefill(
    model: nn.Module, scorer: tuple[nn.Module, str], options: SpecPrefillOptions
) -> SpecPrefill:
    """SpecPrefill for this model, or (its stats saying why) off for its cache layout."""
    stats = SpecPrefillCounters(scorer=scorer[1], enabled=True)
    why = unsupported_layers(make_prompt_cache(model), options.hybrid)
    if why is not None:
        log.warning("SpecPrefill is off for this model: %s", why)
        stats.enabled, stats.notes = False, (f"off: {why}",)
    elif any(not hasattr(c, "keys") for c in make_prompt_cache(model)):
        stats.notes = ("hybrid model: SSM layers see only the kept tokens",)
    return SpecPrefill(scorer[0], options, stats)


def load_draft(
    path: str, cache_dir: Path, model: nn.Module, model_id: str, dequantize_on_cpu: bool
) -> tuple[nn.Module, str]:
    """The draft model and its name; "" means the served model drafts for itself."""
    if not path:
        return model, f"{model_id} (self)"
    draft_id, draft_dir = resolve_model_dir(
        path, cache_dir, log.info, dequantize_on_cpu=dequantize_on_cpu
    )
    log.info("loading draft model %s from %s", draft_id, draft_dir)
    return load_model(draft_dir, dequantize_on_cpu=dequantize_on_cpu)[0], draft_id


def _stop_tokens(processor: Any, config: dict[str, Any]) -> list[int]:
    tokenizer = processor.tokenizer
    ids = set(getattr(getattr(tokenizer, "stopping_criteria", None), "eos_token_ids", []) or [])
    for value in (tokenizer.eos_token_id, config_value(config, "eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(value)
    return sorted(ids)


def load_vlm(
    model_id: str, model_dir: Path, *, max_batch: int, dequantize_on_cpu: bool
) -> tuple[VlmRunner, ModelInfo]:
    """Load an mlx-vlm model directory (weights, processor) for serving."""
    # mlx-vlm (and the processors it pulls in) is imported only when a vision model loads.
    from mlx_vlm.utils import load

    config = json.loads((model_dir / "config.json").read_text())
    model, processor = load(str(model_dir))
    model = dequantize_for_cpu(model, config, dequantize_on_cpu)
    tokenizer = processor.tokenizer
    if not getattr(tokenizer, "chat_template", None) and getattr(processor, "chat_template", None):
        # Many VLM checkpoints keep the template with the processor only: the template
        # traits (tool format, tools in template, reasoning tags) are read from the tokenizer.
        tokenizer.chat_template = processor.chat_template
    template = fallback_templates.settle(tokenizer, processor).status()
    log.info(
        "vision model: %s with %s",
        type(model).__module__,
        type(getattr(processor, "image_processor", None)).__name__,
    )
    info = ModelInfo(
        model_id=model_id,
        model_dir=model_dir,
        context_length=int(config_value(config, "max_position_embeddings", 4096)),
        vocab_size=int(config_value(config, "vocab_size") or len(tokenizer)),
        tokenizer=tokenizer,
        backend=backend(),
        kind="vision",
        processor=processor,
        chat_template=template,
    )
    return VlmRunner(model, _stop_tokens(processor, config), max_batch), info


def _load_vision(
    model_id: str, model_dir: Path, max_batch: int, dequantize_on_cpu: bool, extras: dict
) -> tuple[MlxRunner, ModelInfo]:
    """A vision model: MTP speculation for text-only requests when its text backbone has a
    head; no draft-model or lookup speculation or SpecPrefill yet, and the status says so."""
    runner, info = load_vlm(
        model_id, model_dir, max_batch=max_batch, dequantize_on_cpu=dequantize_on_cpu
    )
    speculative = extras["speculative"]
    if speculative is not None:
        runner, stats = _vision_speculation(runner, model_dir, speculative, dequantize_on_cpu)
        runner.spec_stats = stats
    info = dataclasses.replace(info, memory=memory_model(runner, extras["memory"]))
    if extras["spec_prefill"] is not None:
        log.warning("SpecPrefill is not implemented for vision models: off")
        runner.spec_prefill_stats = _prefill_off("vision models prefill in full")
    return runner, info


def _vision_speculation(
    runner, model_dir: Path, speculative: SpeculativeOptions, dequantize_on_cpu: bool
):
    """The runner and its speculation stats: MTP for text-only requests, or off and why.

    Not lookup: its rows draft different counts, and mlx-vlm's Qwen3.5 language model
    decodes right-padded verify rows wrongly (measured: greedy output differs)."""
    if speculative.drafter in ("draft_model", "lookup"):
        log.warning("%s speculation is not implemented for vision models: off", speculative.drafter)
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


def lookup_drafter(options: SpeculativeOptions) -> LookupDrafter:
    """Prompt lookup with the configured n-gram bounds (no model to load)."""
    log.info("speculative decoding: drafting by n-gram lookup in each request's tokens")
    return LookupDrafter(options.lookup_max_ngram, options.lookup_min_ngram)


def load_mtp_drafter(model: nn.Module, model_dir: Path, config: dict, dequantize_on_cpu: bool):
    """The model's own MTP head as a drafter; ``ValueError`` saying why it has none."""
    head = dequantize_for_cpu(load_mtp(model_dir, config), config, dequantize_on_cpu)
    log.info("speculative decoding: drafting with the model's MTP head")
    return MTPDrafter(head, model, name="mtp")


def _helpers(model, model_id, options: LoadOptions, where):
    """The drafter (speculation) and the SpecPrefill scorer, sharing one load when they can.

    ``where``: the model's directory and config (an MTP head is read from there).
    """
    speculative, spec_prefill = options.speculative, options.spec_prefill
    cache_dir, dequantize_on_cpu = options.cache_dir, options.dequantize_on_cpu
    draft, drafter, off = None, "", None
    if speculative is not None and speculative.drafter == "lookup":
        draft = lookup_drafter(speculative)
        drafter = draft.name
    if speculative is not None and speculative.drafter in ("auto", "mtp"):
        try:
            draft = load_mtp_drafter(model, *where, dequantize_on_cpu)
            drafter = draft.name
        except ValueError as exc:
            if speculative.drafter == "mtp":
                log.warning("speculative decoding is off: %s", exc)
                off = _off(f"drafter = mtp: {exc}")
    if speculative is not None and draft is None and off is None:
        draft, drafter = load_draft(
            speculative.draft_model, cache_dir, model, model_id, dequantize_on_cpu
        )
    sparse = None
    if spec_prefill is not None:
        usable = isinstance(draft, nn.Module)  # an MTP head or prompt lookup cannot score
        scorer = (draft, drafter) if usable and not spec_prefill.scorer_model else None
        scorer = scorer or load_draft(
            spec_prefill.scorer_model, cache_dir, model, model_id, dequantize_on_cpu
        )
        sparse = make_spec_prefill(model, scorer, spec_prefill)
    return draft, drafter, sparse, off


def load_runner(
    path: str, cache_dir: Path, *, shard: Shard | None = None, **options: Any
) -> tuple[MlxRunner, ModelInfo]:
    """``load_served`` with the options as keyword arguments (``LoadOptions``' fields)."""
    return load_served(LoadOptions(path=path, cache_dir=cache_dir, **options), shard)


def load_served(options: LoadOptions, shard: Shard | None = None) -> tuple[MlxRunner, ModelInfo]:
    """Load the model for serving; call on the generation thread.

    The kind (text or vision) comes from the model's config unless ``options.kind``
    names it. Each feature is off where its options are None; without ``memory`` (the
    memory estimate and budget) the engine has no memory gate. ``shard``: this rank's
    part of a model served over a distributed group (text models only). An adapter is
    applied at load (text models only). ``prefill_streams``: MLX streams a prefill chunk
    is split across (``MlxRunner.use_prefill_streams``; None: as ``auto_prefill_streams``
    says). ``chunked_linear_attention``: Qwen3.5 GatedDeltaNet layers prefill chunk by
    chunk (``linear_attention.py``; None: where it applies).
    """
    o = options
    model_id, model_dir = resolve_model_dir(
        o.path, o.cache_dir, log.info, dequantize_on_cpu=o.dequantize_on_cpu
    )
    config = json.loads((model_dir / "config.json").read_text())
    kind = model_kind(config, o.kind)
    log.info("loading %s model %s from %s (MLX backend: %s)", kind, model_id, model_dir, backend())
    if kind == "embedding":
        return _load_embedding(model_id, model_dir, o, shard)  # type: ignore[return-value]
    if kind == "vision" and shard is not None:
        raise ValueError(f"{model_id}: vision models cannot be served over several ranks yet")
    if kind == "vision" and o.adapter_path is not None:
        raise ValueError(f"{model_id}: LoRA adapters are applied to text models only")
    if kind == "vision" and o.kv_bits:
        log.warning("engine.kv_bits: %s is a vision model; its KV stays full precision", model_id)
    if kind == "vision":
        extras = {"memory": o.memory, "speculative": o.speculative, "spec_prefill": o.spec_prefill}
        runner, info = _load_vision(model_id, model_dir, o.max_batch, o.dequantize_on_cpu, extras)
        return runner, dataclasses.replace(info, adapters_refused=_VISION_ADAPTERS)
    model, tokenizer, config = load_model(
        model_dir, dequantize_on_cpu=o.dequantize_on_cpu, shard=shard, adapter_path=o.adapter_path
    )
    if o.adapter_path is not None:
        log.info("LoRA adapter applied: %s", o.adapter_path)
    _chunk_linear_attention(model, o.chunked_linear_attention)
    info = ModelInfo(
        model_id=model_id,
        model_dir=model_dir,
        context_length=int(config_value(config, "max_position_embeddings", 4096)),
        vocab_size=int(config_value(config, "vocab_size") or len(tokenizer.vocab)),
        tokenizer=tokenizer,
        backend=backend(),
        chat_template=fallback_templates.settle(tokenizer).status(),
    )
    cache = make_prefix_cache(o.prefix_cache)
    stops = sorted(tokenizer.eos_token_ids)
    draft, drafter, sparse, off = _helpers(model, model_id, o, (model_dir, config))
    make_cache = _quantized_kv(model, o, sparse)
    _attach_disk(cache, o, model_dir, make_cache or (lambda: make_prompt_cache(model)))
    on = sparse if sparse is not None and sparse.stats.enabled else None
    bank, refused = _adapter_bank(model, model_id, o, shard, drafted=draft is not None)
    runner: MlxRunner
    if draft is not None:
        runner = make_speculative_runner(
            model,
            draft,
            stops,
            o.max_batch,
            o.speculative,
            cache,
            drafter,
            spec_prefill=on,
            make_cache=make_cache,
        )
    else:
        runner = MlxRunner(
            model,
            stops,
            o.max_batch,
            prefix_cache=cache,
            spec_prefill=on,
            make_cache=make_cache,
            adapters=bank,
        )
    targets = dict(bank.targets) if bank is not None else {}
    info = dataclasses.replace(info, lora_targets=targets, adapters_refused=refused)
    runner.spec_stats = runner.spec_stats or off
    runner.spec_prefill_stats = sparse.stats if sparse is not None else None
    _prefill_policy(runner, o)
    return runner, dataclasses.replace(info, memory=memory_model(runner, o.memory))


_VISION_ADAPTERS = "it is a vision model (adapters per request serve text models only)"


def _adapter_bank(
    model: nn.Module, model_id: str, o: LoadOptions, shard: Shard | None, *, drafted: bool
) -> tuple[AdapterBank | None, str]:
    """The model's per-request LoRA adapters (``actors/engine/adapters``), or None and
    why not: no drafter drafts for an adapter row (``drafted``: speculative decoding is
    on), MLX's layers must hold the wrapper's contract, the model must be on one rank,
    and an adapter fused at load (``adapter_path``) leaves no plain layer to wrap."""
    if drafted:
        return None, (
            "speculative decoding is on for it (speculative.enabled): no adapter row is drafted for"
        )
    if shard is not None:
        return None, "it is served over several ranks (distributed)"
    if o.adapter_path is not None:
        return None, f"an adapter is already applied to it at load ({o.adapter_path})"
    broken = multi_lora.check_contract()
    if broken:
        log.warning("%s: no LoRA adapters per request: %s", model_id, broken)
        return None, f"this MLX cannot serve them ({broken})"
    bank = AdapterBank(
        model, model_id, max_adapters=o.max_adapters, memory_bytes=o.adapter_memory_bytes
    )
    return bank, ""


def _prefill_policy(runner: MlxRunner, o: LoadOptions) -> None:
    """The backend's prefill streams and batched-prefill rows (``backend_policy``), unless
    the settings name them."""
    choice = backend_policy.prefill(
        backend(),
        streams=o.prefill_streams,
        batch_prefill=o.batch_prefill,
        max_context=o.batch_prefill_max_context,
    )
    _split_prefill(runner, choice.streams)
    if not choice.batch_every and choice.max_context:  # only short rows share passes
        runner.batch_prefill_max_context = choice.max_context


def _attach_disk(cache: PrefixCache | None, o: LoadOptions, model_dir: Path, make_cache) -> None:
    """The prefix cache's disk tier (``prefix_cache.disk_dir``), in a space keyed by
    everything that changes a snapshot's bytes (``disk_codec.namespace_key``)."""
    if cache is None or o.disk_tier is None:
        return
    extra = {
        "chat_template": hashlib.sha256(o.disk_tier.chat_template.encode()).hexdigest(),
        "kv_bits": o.kv_bits,
        "kv_group_size": o.kv_group_size if o.kv_bits else 0,
        "draft_model": o.speculative.draft_model if o.speculative else "",
    }
    key = disk_codec.namespace_key(model_dir, o.adapter_path, make_cache(), extra)
    store, base_slug = o.disk_tier.store, o.disk_tier.slug

    def for_adapter(name: str, fingerprint: str):
        """An adapter's own space: its slug under the base's, its files in the key."""
        return store.space(adapter_slug(base_slug, name), {**key, "adapter": fingerprint})

    disk_codec.attach(cache, store.space(base_slug, key), for_adapter)


def _quantized_kv(model: nn.Module, o: LoadOptions, sparse: SpecPrefill | None):
    """The cache factory with quantized attention KV (``engine.kv_bits``; None: off, or
    nothing to quantize). SpecPrefill is then off: its sparse prefill positions plain
    ``KVCache`` layers only."""
    if not o.kv_bits:
        return None
    # here, not at the top: kv_quant builds on mlx-vlm's cache, whose import brings in
    # much of mlx-vlm, which a server without kv_bits never needs
    from mlxd.actors.engine.runner import kv_quant

    make = kv_quant.cache_factory(
        model, lambda: make_prompt_cache(model), o.kv_bits, o.kv_group_size
    )
    if make is not None and sparse is not None and sparse.stats.enabled:
        why = "engine.kv_bits (a quantized attention layer keeps no skipped positions)"
        log.warning("SpecPrefill is off: %s", why)
        sparse.stats.enabled, sparse.stats.notes = False, (f"off: {why}",)
    return make


def _load_embedding(
    model_id: str, model_dir: Path, o: LoadOptions, shard: Shard | None
) -> tuple[EmbeddingRunner, ModelInfo]:
    """An embedding model: its body (mlx-lm's, or mlx-embeddings' for an encoder) under
    mlxd's pooling head (``runner/embedding.py``)."""
    if shard is not None or o.adapter_path is not None:
        raise ValueError(f"{model_id}: embedding models load on one rank, without adapters")
    config = json.loads((model_dir / "config.json").read_text())
    backend_name = "mlx-embeddings" if config.get("model_type") in ENCODERS else "mlx-lm"
    if backend_name == "mlx-embeddings":
        body, tokenizer = load_encoder(model_dir, config)
    else:
        model, tokenizer, config = load_model(model_dir, dequantize_on_cpu=o.dequantize_on_cpu)
    context = int(config_value(config, "max_position_embeddings", 4096))
    vocab = int(config_value(config, "vocab_size") or len(tokenizer.vocab))
    if backend_name == "mlx-lm":
        body = find_body(model, config_value(config, "hidden_size"), vocab)
    runner = embedding_runner(body, config, model_dir, context, vocab, o.embedding, backend_name)
    info = ModelInfo(
        model_id=model_id,
        model_dir=model_dir,
        context_length=context,
        vocab_size=vocab,
        tokenizer=tokenizer,
        backend=backend(),
        kind="embedding",
        embedding=runner.info,
    )
    return runner, info


def _chunk_linear_attention(model: nn.Module, wanted: bool | None) -> None:
    """Qwen3.5 GatedDeltaNet layers prefill chunk by chunk where wanted (None: where
    ``linear_attention.applies``)."""
    if wanted is None:
        wanted = linear_attention.applies()
    if wanted and (swapped := linear_attention.install(model)):
        log.info("%d GatedDeltaNet layers prefill chunk by chunk (linear_attention.py)", swapped)


def _split_prefill(runner: MlxRunner, streams: int) -> None:
    runner.use_prefill_streams(streams)
    if streams > 1:
        log.info("prefill chunks run as %d pieces on as many MLX streams", streams)


def auto_prefill_streams() -> int:
    """``engine.prefill_streams = "auto"``: the backend table's (``backend_policy``)."""
    return backend_policy.prefill(backend()).streams
