"""Wire structs of ``GET /v1/status``: what the server is doing right now, as JSON.

Byte figures are bytes, ages and durations seconds. The engine's counter sets
(``EngineStats``, ``SpeculativeCounters``, ``SpecPrefillCounters``) are encoded as the
engine published them: one type each, from the engine to the wire (``messages.py``).
``CacheStatus`` joins the requests' prompt-token totals with the prefix cache's counters.
Nothing here imports trio or mlx.
"""

from __future__ import annotations

from typing import Any

import msgspec
from mlxd.protocol.messages import (
    DiskCounters,
    EngineStats,
    SpecPrefillCounters,
    SpeculativeCounters,
)


class RequestStatus(msgspec.Struct, kw_only=True):
    """One in-flight request. ``state``: ``queued`` (admission queue), ``waiting``
    (tokenizing, waiting for its model to load, or for memory in the engine) or
    ``running``."""

    id: str
    model: str
    state: str
    age_s: float
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int


class RequestsStatus(msgspec.Struct, kw_only=True):
    running: list[RequestStatus]
    waiting: list[RequestStatus]


class AdmissionStatus(msgspec.Struct, kw_only=True):
    running: int
    waiting: int
    max_running: int
    max_waiting: int
    rejected: int
    expired: int


class MemoryStatus(msgspec.Struct, kw_only=True):
    active_bytes: int
    peak_bytes: int
    kv_reserved_bytes: int
    kv_budget_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_request: int


class CacheStatus(msgspec.Struct, kw_only=True):
    """The requests' prompt tokens since start and how many came from a cache
    (``hit_rate``: cached ÷ prompt), then the prefix cache's own counters
    (``PrefixCacheCounters`` but its ``cached_tokens``; ``enabled`` false: none follow)."""

    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    enabled: bool = False  # the prefix cache's own counters follow
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    disk_hits: int = 0  # of the hits, snapshots read back from the disk tier
    disk_cached_tokens: int = 0
    disk: DiskCounters | None = None  # the disk tier (shared by the models); None: off


class WarmupStatus(msgspec.Struct, kw_only=True):
    """The warm-up a model ran after loading, before its first request (``engine.warmup``):
    seconds, the largest decode batch (every size down to 1 ran) and the prompt lengths."""

    seconds: float
    max_batch: int
    prompt_tokens: list[int]


class ChatTemplateStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Which chat template serves a model. ``source``: ``model`` (its own), ``setting``
    (``model.chat_template``), ``family`` (the model has none: mlxd's template for the
    ``family`` whose turn tokens its vocabulary has) or ``concatenation`` (none, and no
    family: the messages' text); ``why`` says what decided."""

    source: str
    why: str
    family: str = ""


class FimStatus(msgspec.Struct, frozen=True, kw_only=True):
    """The model's fill-in-the-middle format (``actors/families/fim.py``; None: it has no
    FIM tokens, and FIM requests get a 400) and ``why``."""

    format: str | None
    why: str


class ModelStatus(msgspec.Struct, kw_only=True):
    id: str
    backend: str
    context_length: int
    kind: str = "text"
    warmup: WarmupStatus | None = None  # None: not warmed up (off, or an embedding model)
    chat_template: ChatTemplateStatus | None = None  # None: an embedding model
    fim: FimStatus | None = None  # None: not known yet (no request has been built for it)


class ServedModel(msgspec.Struct, kw_only=True):
    """One entry of the served models. ``state``: ``unloaded`` (not loaded yet, or
    unloaded), ``loading``, ``loaded`` or ``failed`` (``error`` says why). Load and
    unload times are the last ones, in seconds; ``last_unload_reason``: ``idle``
    (``model_pool.idle_unload_s``), ``lru`` (``max_loaded``) or ``memory``
    (``max_loaded_mb``). ``model`` is known once it has loaded; ``engine`` while loaded."""

    id: str
    state: str
    error: str
    loads: int
    unloads: int
    last_load_s: float
    last_unload_s: float
    last_unload_reason: str
    weights_bytes: int
    waiting_for_load: int
    model: ModelStatus | None
    engine: EngineStats | None


class ServedAdapter(msgspec.Struct, kw_only=True):
    """One served LoRA adapter over the model ``base``; ``source``: ``settings`` or ``api``
    (``POST /v1/load_lora_adapter``). ``state``: ``failed`` when its files do not fit its
    base (``error`` says why), else its base's; ``bytes``: its tensors once loaded (0 until
    a request has used it)."""

    id: str
    base: str
    path: str
    source: str
    state: str
    error: str
    bytes: int


class Status(msgspec.Struct, kw_only=True):
    """The server; ``model`` is the default model, ``engine`` every loaded model's counts
    added up, and ``models`` each served model on its own."""

    state: str
    uptime_s: float
    model: ModelStatus | None
    models: list[ServedModel]
    requests: RequestsStatus
    admission: AdmissionStatus
    engine: EngineStats
    memory: MemoryStatus
    cache: CacheStatus
    speculative: list[SpeculativeCounters]  # one per drafter; [] when speculation is not configured
    spec_prefill: SpecPrefillCounters | None  # None when SpecPrefill is not configured
    settings: dict[str, Any]
    adapters: list[ServedAdapter] = []  # the LoRA adapters served over ``models``
