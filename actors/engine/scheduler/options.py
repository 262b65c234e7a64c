"""The typed options of a served model's load, for ``loading.load_served``.

``LoadOptions`` holds everything the loader takes from the settings; one function
maps the settings tree onto it (``daemon/supervisor.load_options``), for ``serve``,
the ranks of ``serve --parallel`` and ``bench --engine`` alike. Nothing in
``actors/`` reads a settings section. A feature is off where its options are None.
No mlx here: the daemon imports this module before any model code loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class MemoryOptions:
    """How much device memory requests may take, and MLX's own limits (``[memory]``)."""

    device_fraction: float = 0.9  # of device memory, for weights and requests together
    headroom_mb: int = 1024  # kept free besides
    kv_budget_mb: int = 0  # an explicit request budget (0: what the fraction leaves)
    set_mlx_limit: bool = True  # make MLX's memory limit the same fraction
    cache_limit_mb: int = 256  # freed buffers MLX keeps for reuse
    admission: Literal["use", "reserve"] = "use"  # what a running row is counted for
    decode_reserve_tokens: int = 256  # "use": the growth margin a row is admitted with


@dataclass(frozen=True)
class PrefixCacheOptions:
    """Snapshot block size and budget (``max_bytes``, else ``memory_fraction`` of the device)."""

    block_size: int = 64
    max_bytes: int = 0
    memory_fraction: float = 0.1
    affinity_keys: int = 16  # cache keys whose newest snapshot is evicted last


@dataclass(frozen=True)
class DiskTierOptions:
    """The prefix cache's disk tier for one model: the daemon's store (a
    ``runner.disk_tier.DiskStore``, shared by the models), the model's directory name in
    it, and what its key needs that the loader does not see (the chat template override)."""

    store: Any
    slug: str
    chat_template: str = ""


@dataclass(frozen=True)
class SpeculativeOptions:
    """Which drafter proposes how many tokens, up to which batch size."""

    drafter: Literal["auto", "mtp", "draft_model", "lookup"] = "auto"
    draft_model: str = ""  # "": the served model drafts for itself
    num_draft_tokens: int = 3
    max_batch: int = 8
    lookup_max_ngram: int = 3  # prompt lookup: longest suffix matched, tried first
    lookup_min_ngram: int = 1  # shortest suffix matched


@dataclass(frozen=True)
class SpecPrefillOptions:
    """When SpecPrefill applies to a prompt, how much of it is kept, and who scores it."""

    by_default: bool = True  # for requests that do not say
    threshold_tokens: int = 2048  # uncached prompt tokens it needs to apply
    keep_fraction: float = 0.3
    chunk_tokens: int = 64
    scorer_model: str = ""  # "": the draft model when speculating, else the served model
    hybrid: bool = False  # also on models with SSM layers (they see only kept tokens)


@dataclass(frozen=True)
class EmbeddingOptions:
    """An embedding model's pooling and the batching of its inputs (``[embeddings]`` and
    the ``[[models]]`` entry's pooling fields)."""

    pooling: Literal["auto", "mean", "cls", "last"] = "auto"  # auto: the model's files say
    normalize: bool = True  # L2-normalise every vector
    matryoshka: tuple[int, ...] = ()  # sizes it may be truncated to, besides the model's own
    max_input_tokens: int = 0  # longest input, within the model's context (0: the context)
    max_batch_inputs: int = 32  # inputs per forward pass
    max_batch_tokens: int = 8192  # padded tokens per forward pass (inputs x the longest)
    max_queued_inputs: int = 4096  # inputs waiting for this model; more: 429


@dataclass(frozen=True, kw_only=True)
class LoadOptions:
    """How one served model loads: where from, its batch, the engine's loader options
    and each feature's options (None: off)."""

    path: str  # model dir, .gguf file or Hugging Face id; "": the default model
    cache_dir: Path  # converted GGUF files and Hub downloads
    dequantize_on_cpu: bool
    max_batch: int
    kind: str = "auto"  # text, vision or embedding; auto: text or vision from the config
    adapter_path: Path | None = None  # an mlx-lm LoRA adapter applied at load
    # LoRA adapters chosen per request (``actors/engine/adapters``): at most this many
    # resident at once, within this many bytes (least recently used idle ones evicted)
    max_adapters: int = 8
    adapter_memory_bytes: int = 1 << 30
    prefill_streams: int | None = None  # MLX streams a prefill chunk is split over (None: auto)
    chunked_linear_attention: bool | None = None  # Qwen3.5 GatedDeltaNet (None: where it pays)
    batch_prefill: bool | None = None  # every row shares passes, or none (None: the table's)
    # batch_prefill None where the backend batches only short rows: rows whose context
    # stays within this many tokens are prefilled together (None: the backend table's)
    batch_prefill_max_context: int | None = None
    kv_bits: int = 0  # attention KV quantized to 4 or 8 bits (0: the model's precision)
    kv_group_size: int = 64  # values per quantization group
    prefix_cache: PrefixCacheOptions | None = None
    disk_tier: DiskTierOptions | None = None  # the prefix cache's disk tier (None: off)
    memory: MemoryOptions | None = None  # None: no memory estimate, no memory gate
    speculative: SpeculativeOptions | None = None
    spec_prefill: SpecPrefillOptions | None = None
    embedding: EmbeddingOptions = EmbeddingOptions()  # kind "embedding" only
