"""The typed settings tree: ``config/default.toml``, then an optional user file, then
``MLXD_<SECTION>__<KEY>`` environment variables, then command-line flags."""

from __future__ import annotations

import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "default.toml"


Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
KV_BITS = (0, 4, 8)  # engine.kv_bits: off, or bits per quantized key / value
KV_GROUP_SIZES = (32, 64, 128)  # engine.kv_group_size: the group sizes MLX quantizes in


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


def _require(ok: bool, message: str) -> None:
    """A check in ``__post_init__``: msgspec reports the ValueError with the field's path."""
    if not ok:
        raise ValueError(message)


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: Port = 8000
    max_body_bytes: Positive = 4_194_304
    # on SIGTERM/SIGINT, /health says "draining" (503) this long before new requests are
    # refused, so a router in front (`mlxd cluster`) sends them elsewhere first
    drain_notice_s: Seconds = 0.0
    drain_timeout_s: Seconds = 30.0
    flush_timeout_s: Seconds = 5.0
    send_timeout_s: Seconds = 30.0
    # a request body still incomplete this long after the request began: cut off
    body_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    backlog: Positive = 1024
    idle_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
    max_connections: NonNegative = 512
    cors_origins: list[str] = []
    allowed_hosts: list[str] = []
    max_json_depth: Annotated[int, msgspec.Meta(ge=2, le=512)] = 64

    def __post_init__(self) -> None:
        _require(
            all(h.strip() for h in self.allowed_hosts), "server.allowed_hosts: empty host name"
        )


class ModelSettings(_Section):
    path: str = ""
    served_id: str = ""
    # a request's unknown ``model`` id: served by the first model (true), a 404 (false);
    # "auto": true when one model is served, false with several ``[[models]]``
    accept_other_ids: bool | Literal["auto"] = "auto"
    cache_dir: str = "~/.cache/mlxd"
    dequantize_on_cpu: bool = True
    kind: Literal["auto", "text", "vision", "embedding"] = "auto"
    chat_template: str = ""
    # LoRA adapters chosen per request (served id → adapter directory), over this model
    adapters: dict[str, str] = {}
    # adapters resident at once per model, and the memory they may take (least recently
    # used idle ones are dropped); a [[models]] entry's own values (0) default to these
    max_adapters: Positive = 8
    adapter_memory_mb: Positive = 1024

    def chat_template_text(self) -> str:
        """The server's chat template: ``chat_template`` itself when it holds a Jinja tag,
        else the file it names ("" = the model's own); ``ValueError`` if it cannot be read."""
        value = self.chat_template
        if not value or "{" in value:
            return value
        path = Path(value).expanduser()
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"model.chat_template: cannot read {path}: {exc}") from None


class AdmissionSettings(_Section):
    max_running: Positive = 32
    max_waiting: NonNegative = 64
    retry_after_s: Positive = 1
    queue_timeout_s: Seconds = 60.0
    request_timeout_s: Seconds = 600.0
    priority: bool = False


class AuthSettings(_Section):
    api_keys: list[str] = []
    api_key_file: str = ""

    def __post_init__(self) -> None:
        # An empty key would be dropped, silently leaving the API open.
        _require(all(k.strip() for k in self.api_keys), "auth.api_keys: empty API key")
        _require(
            all(k == k.strip() for k in self.api_keys),
            "auth.api_keys: a key with leading or trailing whitespace can never match",
        )


class MemorySettings(_Section):
    device_fraction: Fraction = 0.9
    headroom_mb: NonNegative = 1024
    kv_budget_mb: NonNegative = 0
    set_mlx_limit: bool = True
    cache_limit_mb: NonNegative = 256
    release_after_idle_s: Seconds = 2.0
    admission: Literal["use", "reserve"] = "use"
    decode_reserve_tokens: Positive = 256


class TokenizerSettings(_Section):
    workers: Positive = 2
    max_messages: Positive = 1000
    tool_format: str = "auto"
    reasoning_tags: str = "auto"
    max_tools: Positive = 128
    max_tool_chars: Positive = 65_536
    count_tokens_max_waiting: NonNegative = 8
    constrain_auto_calls: bool = True
    max_integer_digits: Positive = 18
    max_fraction_digits: Positive = 10
    grammar_cache_size: NonNegative = 64

    def __post_init__(self) -> None:
        _check_output_formats(self.tool_format, self.reasoning_tags, "tokenizer.")
        _require(
            self.max_integer_digits <= 18,
            "tokenizer.max_integer_digits: at most 18 (the digits every 64-bit integer holds)",
        )
        _require(
            self.max_fraction_digits <= 10,
            "tokenizer.max_fraction_digits: at most 10 (llguidance's multipleOf is exact to 1e-10)",
        )


def _check_output_formats(tool_format: str, tags: str, where: str) -> None:
    """``tool_format`` and ``reasoning_tags`` (of ``[tokenizer]`` or a ``[[models]]`` entry)."""
    from mlxd.actors.families.formats import TOOL_FORMATS  # plain Python, no trio or mlx

    _require(
        tool_format in ("auto", *TOOL_FORMATS),
        f"{where}tool_format: {tool_format!r} is not one of auto, " + ", ".join(TOOL_FORMATS),
    )
    open_tag, comma, close_tag = tags.partition(",")
    _require(
        tags in ("auto", "none") or bool(comma and open_tag.strip() and close_tag.strip()),
        f"{where}reasoning_tags: {tags!r} is not auto, none or '<open>,<close>'",
    )


class EngineSettings(_Section):
    max_batch: Positive = 32
    # "auto" in the prefill settings: the backend's value (actors/engine/backend_policy.py)
    prefill_chunk_tokens: Positive | Literal["auto"] = "auto"
    # a prompt with at most this many tokens left to prefill is not split over two
    # steps: when the step's budget cannot take it whole it goes in the next; 0 = split
    prefill_unsplit_tokens: NonNegative | Literal["auto"] = "auto"
    batch_prefill: bool | Literal["auto"] = "auto"
    # batch_prefill "auto" where the backend batches only short rows (the CPU): rows whose
    # context (cached + this chunk) stays within this many tokens are prefilled together
    batch_prefill_max_context: NonNegative | Literal["auto"] = "auto"
    prefill_streams: Positive | Literal["auto"] = "auto"
    # run the shapes serving meets before "ready" (and before a model loaded later takes
    # its first request): "auto" = the backend's set, true = every decode batch size up to
    # warmup_max_batch and a full prefill chunk, false = none
    warmup: bool | Literal["auto"] = "auto"
    warmup_max_batch: NonNegative | Literal["auto"] = "auto"  # 0 = the model's max_batch
    # where MLX keeps the GPU kernels it compiles (daemon/kernel_cache.py): "auto" = under
    # the user's cache directory, "" = MLX's default (the temp directory), or a path
    kernel_cache_dir: str = "auto"
    blas_threads: NonNegative = 0
    chunked_linear_attention: bool | Literal["auto"] = "auto"
    default_max_tokens: Positive = 512
    max_tokens_cap: NonNegative = 0  # 0: the model's context
    # a request's max_tokens above what fits (this cap, the context left after the prompt,
    # the memory budget): "clamp" lowers it to fit, "refuse" answers 400
    max_tokens_overflow: Literal["clamp", "refuse"] = "clamp"
    max_prompt_tokens: NonNegative = 0
    max_stop_strings: NonNegative = 16
    max_stop_length: Positive = 256
    max_n: Positive = 8
    max_top_logprobs: NonNegative = 20
    max_logit_bias: NonNegative = 300
    # attention layers keep keys and values quantized to this many bits (4 or 8; 0 = off,
    # the model's precision), in groups of kv_group_size (32, 64 or 128) values
    kv_bits: NonNegative = 0
    kv_group_size: Positive = 64

    def __post_init__(self) -> None:
        _require(
            self.kv_bits in KV_BITS,
            f"engine.kv_bits: 4 or 8 (bits per quantized key/value), or 0 for off; "
            f"got {self.kv_bits}",
        )
        _require(
            self.kv_group_size in KV_GROUP_SIZES,
            f"engine.kv_group_size: 32, 64 or 128; got {self.kv_group_size}",
        )


class PrefixCacheSettings(_Section):
    enabled: bool = True
    system_prompt: bool = True
    block_size: Positive = 64
    max_bytes: int = 0
    memory_fraction: float = 0.1
    # client breakpoints (Anthropic cache_control) snapshotted per request, the last ones
    # kept; each costs a render and an encode of the prompt up to it
    max_breakpoints: NonNegative = 4
    # cache keys (Responses prompt_cache_key) whose newest snapshot outlives keyless ones
    affinity_keys: NonNegative = 16
    # the disk tier: snapshots evicted from RAM, unloaded or left at shutdown are written
    # here and read back on a RAM miss; "" = off (it writes up to disk_max_bytes)
    disk_dir: str = ""
    disk_max_bytes: Positive = 20 << 30  # the files never take more (LRU)
    # spilled snapshots waiting for the disk writer; past it a spill is dropped
    disk_write_queue_bytes: Positive = 1 << 30
    # every snapshot made is written at most this long after (0: only evicted, unloaded
    # and shutdown ones), so a kill -9 loses at most this long; the wait lets a turn's
    # longer snapshot replace its shorter ones before either is written
    disk_write_behind_s: Seconds = 2.0
    # attention KV is written in blocks of this many tokens, each once however many
    # snapshots share it (0: each snapshot whole)
    disk_block_tokens: NonNegative = 256


class SpeculativeSettings(_Section):
    enabled: bool = False
    drafter: Literal["auto", "mtp", "draft_model", "lookup"] = "auto"
    draft_model: str = ""
    num_draft_tokens: Positive = 3
    max_batch: Positive = 8
    lookup_max_ngram: Positive = 3
    lookup_min_ngram: Positive = 1

    def __post_init__(self) -> None:
        _require(
            self.lookup_min_ngram <= self.lookup_max_ngram,
            "speculative.lookup_min_ngram: more than lookup_max_ngram",
        )


class SpecPrefillSettings(_Section):
    enabled: bool = False
    by_default: bool = True
    threshold_tokens: Positive = 2048
    keep_fraction: Fraction = 0.3
    chunk_tokens: Positive = 64
    scorer_model: str = ""
    hybrid: bool = False


class VisionSettings(_Section):
    max_images: int = 8
    max_image_bytes: Positive = 8_388_608
    max_image_pixels: Positive = 16_777_216
    allow_remote_urls: bool = False
    remote_timeout_s: float = 10.0


class ResponsesSettings(_Section):
    """The OpenAI Responses API (``/v1/responses``)."""

    # hosted tools mlxd cannot run (web_search, file_search, ...): false = left out of the
    # prompt with a log line, true = a 400
    strict_hosted_tools: bool = False
    # the store of ``store: true`` responses (for previous_response_id and GET/DELETE):
    # the oldest go first past either cap; entries expire this long after they are stored
    store_max_entries: Positive = 1024
    store_max_bytes: Positive = 268_435_456
    store_ttl_s: Seconds = 86_400.0  # 0 = no expiry
    # the key that signs reasoning items' encrypted_content: "" = random per start (items
    # from before a restart are then refused), else a file keeping it (made if missing)
    reasoning_key_file: str = ""


class FimSettings(_Section):
    """Fill-in-the-middle (``/infill``, ``suffix`` on ``/v1/completions`` and Ollama's
    ``/api/generate``)."""

    max_extra_files: NonNegative = 64  # input_extra entries per request; more is a 400
    repo_name: str = "project"  # the repository name the families' layouts write
    # a newer FIM request from the same client on the same file, once started, ends the older
    supersede: bool = True
    max_detokenize_tokens: Positive = 131_072  # token ids per /detokenize request; more: a 400


class StreamingSettings(_Section):
    engine_outbox: Positive = 4
    max_unread_bytes: NonNegative = 4_194_304
    # a stream quiet this long (a long prefill) gets its API's keep-alive frame; 0: never
    keepalive_s: Seconds = 10.0


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class LoggingSettings(_Section):
    level: str = "INFO"

    def __post_init__(self) -> None:
        self.level = self.level.upper()
        _require(
            self.level in LOG_LEVELS,
            f"logging.level: {self.level!r} is not one of {', '.join(LOG_LEVELS)}",
        )


class ModelEntry(_Section):
    """One served model of ``[[models]]``; ``speculative`` / ``spec_prefill`` (sub-tables)
    replace the global sections for this model only."""

    id: str  # the request's ``model`` that selects it
    path: str = ""  # model dir, .gguf file or Hugging Face id; "" = SmolLM2-135M-Instruct
    kind: Literal["auto", "text", "vision", "embedding"] = "auto"
    # kind = "embedding" only: how hidden states become one vector ("auto": the model's
    # sentence-transformers files, else "last"), and the sizes its vectors may be cut to
    # (Matryoshka; [] = the model's config.json matryoshka_dimensions, if any)
    pooling: Literal["auto", "mean", "cls", "last"] = "auto"
    matryoshka_dimensions: list[Annotated[int, msgspec.Meta(ge=1)]] = []
    adapter_path: str = ""  # an mlx-lm LoRA adapter directory applied at load; "" = none
    # LoRA adapters chosen per request: served id → directory (mlx-lm's or PEFT's files)
    adapters: dict[str, str] = {}
    max_adapters: NonNegative = 0  # 0 = model.max_adapters
    adapter_memory_mb: NonNegative = 0  # 0 = model.adapter_memory_mb
    max_batch: NonNegative = 0  # 0 = engine.max_batch
    preload: bool = False  # load at start-up instead of on first use
    chat_template: str = ""  # a Jinja string or a file; "" = model.chat_template's rule
    tool_format: str = ""  # "" = tokenizer.tool_format
    reasoning_tags: str = ""  # "" = tokenizer.reasoning_tags
    speculative: SpeculativeSettings | None = None
    spec_prefill: SpecPrefillSettings | None = None

    def __post_init__(self) -> None:
        where = f"models {self.id!r}: "
        _check_output_formats(self.tool_format or "auto", self.reasoning_tags or "auto", where)
        _check_adapters(self.adapters, f"{where}adapters")
        _require(
            not (self.adapters and self.kind == "embedding"),
            f"{where}adapters: an embedding model takes no LoRA adapters",
        )

    def chat_template_text(self, fallback: str) -> str:
        """This entry's chat template (a Jinja string, or the file it names), else
        ``fallback`` (``model.chat_template``'s); ``ValueError`` if it cannot be read."""
        value = self.chat_template
        if not value:
            return fallback
        if "{" in value:
            return value
        path = Path(value).expanduser()
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"models {self.id!r}: chat_template: cannot read {path}: {exc}"
            ) from None


def _check_adapters(adapters: Mapping[str, str], where: str) -> None:
    """Each adapter's served id and directory, as one table of them names them."""
    for name, path in adapters.items():
        _require(name.strip() == name != "", f"{where}: an empty or padded adapter id {name!r}")
        _require(path.strip() != "", f"{where}: adapter {name!r} has no path")


def check_adapter_ids(entries: list[ModelEntry]) -> None:
    """``ValueError`` unless every adapter's id is unique among the served models' ids and
    their adapters' (``[model]``'s id is known only once it loads: checked again then)."""
    ids = {e.id for e in entries if e.id}
    seen: dict[str, str] = {}
    for entry in entries:
        for name in entry.adapters:
            owner = entry.id or "[model]"
            _require(name not in ids, f"adapters: {name!r} ({owner}) is a model's id")
            _require(
                name not in seen,
                f"adapters: {name!r} is named twice ({seen.get(name)} and {owner})",
            )
            seen[name] = owner


class EmbeddingsSettings(_Section):
    """``/v1/embeddings``: the limits of a request and of the engine's batches."""

    max_inputs: Positive = 2048  # inputs per request
    max_input_tokens: NonNegative = 8192  # tokens per input (OpenAI's); 0 = the model's context
    max_batch_inputs: Positive = 32  # inputs per forward pass
    max_batch_tokens: Positive = 8192  # padded tokens per forward pass (inputs x the longest)
    max_queued_inputs: Positive = 4096  # inputs waiting for one model; more: 429
    normalize: bool = True  # L2-normalise vectors (cosine similarity = dot product)


class ModelPoolSettings(_Section):
    max_loaded: Positive = 2
    max_loaded_mb: NonNegative = 0
    idle_unload_s: Seconds = 0.0
    max_waiting: NonNegative = 32
    load_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    failed_retry_s: Seconds = 30.0


class DistributedSettings(_Section):
    """One model over several machines (``mlx.launch ... -- mlxd serve MODEL --parallel``)."""

    parallel: Literal["off", "tensor", "pipeline", "auto"] = "off"
    step_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    prefill_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    exit_grace_s: Seconds = 1.0


class DashboardSettings(_Section):
    """The live dashboard at ``/`` and the history it charts (``daemon/history.py``)."""

    enabled: bool = True  # false: no page at /, no /v1/dashboard, no sampling
    sample_period_s: Annotated[float, msgspec.Meta(ge=0.1, le=60)] = 1.0
    history_s: Annotated[float, msgspec.Meta(gt=0, le=86_400)] = 900.0  # samples kept
    recent_requests: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 100  # finished ones listed

    @property
    def max_samples(self) -> int:
        return max(1, round(self.history_s / self.sample_period_s))


class ClusterSettings(_Section):
    """``mlxd cluster``: SGLang's router in front of several daemons (``daemon/cluster.py``)."""

    host: str = "127.0.0.1"
    port: Port = 8080
    workers: list[str] = []  # daemon URLs; --worker flags replace them
    policy: Literal["cache_aware", "round_robin", "manual"] = "cache_aware"
    metrics_port: Port = 29000  # the router's Prometheus exporter
    health_check_interval_s: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 1
    health_failure_threshold: Positive = 1
    health_success_threshold: Positive = 1
    # attempts per request on a refused connection or a 5xx; the waits between them double
    # from retry_backoff_s, so together they outlast a dead daemon's health check
    max_retries: Positive = 5
    retry_backoff_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 0.25
    balance_abs_threshold: NonNegative = 4  # cache_aware: in-flight gap that overrides affinity
    balance_rel_threshold: Annotated[float, msgspec.Meta(ge=1)] = 1.5
    cache_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.3
    request_timeout_s: Positive = 1800
    worker_startup_timeout_s: Positive = 600
    restart_delay_s: Seconds = 2.0  # a router that exits on its own is started again after this
    log_level: Literal["debug", "info", "warn", "error"] = "warn"


class Settings(_Section):
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    model: ModelSettings = msgspec.field(default_factory=ModelSettings)
    admission: AdmissionSettings = msgspec.field(default_factory=AdmissionSettings)
    auth: AuthSettings = msgspec.field(default_factory=AuthSettings)
    memory: MemorySettings = msgspec.field(default_factory=MemorySettings)
    tokenizer: TokenizerSettings = msgspec.field(default_factory=TokenizerSettings)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    prefix_cache: PrefixCacheSettings = msgspec.field(default_factory=PrefixCacheSettings)
    speculative: SpeculativeSettings = msgspec.field(default_factory=SpeculativeSettings)
    spec_prefill: SpecPrefillSettings = msgspec.field(default_factory=SpecPrefillSettings)
    vision: VisionSettings = msgspec.field(default_factory=VisionSettings)
    streaming: StreamingSettings = msgspec.field(default_factory=StreamingSettings)
    fim: FimSettings = msgspec.field(default_factory=FimSettings)
    responses: ResponsesSettings = msgspec.field(default_factory=ResponsesSettings)
    logging: LoggingSettings = msgspec.field(default_factory=LoggingSettings)
    distributed: DistributedSettings = msgspec.field(default_factory=DistributedSettings)
    models: list[ModelEntry] = []
    model_pool: ModelPoolSettings = msgspec.field(default_factory=ModelPoolSettings)
    embeddings: EmbeddingsSettings = msgspec.field(default_factory=EmbeddingsSettings)
    dashboard: DashboardSettings = msgspec.field(default_factory=DashboardSettings)
    cluster: ClusterSettings = msgspec.field(default_factory=ClusterSettings)

    def __post_init__(self) -> None:
        ids = [m.id for m in self.models]
        _require(all(i.strip() == i != "" for i in ids), "models: an empty or padded id")
        _require(len(set(ids)) == len(ids), "models: two entries with the same id")
        _require(
            not (self.models and (self.model.path or self.model.served_id)),
            "models: [[models]] replaces [model] path / served_id; set one or the other",
        )
        _require(
            sum(m.preload for m in self.models) <= self.model_pool.max_loaded,
            "models: more entries with preload = true than model_pool.max_loaded",
        )
        _require(
            not (self.models and self.model.adapters),
            "model.adapters (--adapter) is for the one [model]; with [[models]], give each "
            "entry its own adapters table",
        )
        _check_adapters(self.model.adapters, "model.adapters")
        _require(
            not (self.model.adapters and self.model.kind == "embedding"),
            "model.adapters: an embedding model takes no LoRA adapters",
        )
        check_adapter_ids(self.model_entries())

    def model_entries(self) -> list[ModelEntry]:
        """The served models: ``[[models]]``, or ``[model]`` as one preloaded entry (its id
        "" until loaded: then ``served_id`` or the model's own name)."""
        if self.models:
            return list(self.models)
        m = self.model
        return [
            ModelEntry(
                id=m.served_id, path=m.path, kind=m.kind, preload=True, adapters=dict(m.adapters)
            )
        ]


class SettingsError(ValueError):
    """A config file that does not decode; the message names the file and the field."""


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return msgspec.toml.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise SettingsError(f"{path}: {exc}") from exc


ENV_PREFIX = "MLXD_"


def _field_type(section: str, key: str) -> Any:
    """The declared type of ``[section] key``; None if there is no such setting."""
    sections = {f.name: f.type for f in msgspec.structs.fields(Settings)}
    kind = sections.get(section)
    if not (isinstance(kind, type) and issubclass(kind, msgspec.Struct)):
        return None
    return next((f.type for f in msgspec.structs.fields(kind) if f.name == key), None)


def _env_value(name: str, text: str, kind: Any) -> Any:
    """An environment variable's text as a value of the setting's type: numbers and booleans
    parsed, a list as a JSON array or comma-separated, a table as a JSON object; constraints
    checked."""
    bare = typing.get_args(kind)[0] if typing.get_origin(kind) is Annotated else kind
    try:
        raw: Any = text
        if typing.get_origin(bare) is dict:  # a table: a JSON object
            raw = msgspec.json.decode(text)
        elif typing.get_origin(bare) is list:
            raw = msgspec.json.decode(text) if text.lstrip().startswith("[") else text.split(",")
            raw = [item.strip() if isinstance(item, str) else item for item in raw]
            raw = [item for item in raw if item != ""]
        return msgspec.convert(raw, type=kind, strict=False)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise SettingsError(f"{name}={text!r}: {exc}") from None


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """``MLXD_<SECTION>__<KEY>`` variables (e.g. ``MLXD_SERVER__PORT=9000``) as overrides.

    A variable that names no setting is an error, and so is ``MLXD_SERVER_PORT`` (one
    underscore) or ``MLXD_MODELS`` (a section, no key); other ``MLXD_*`` names are not
    settings (``MLXD_BLAS_CHECKED``)."""
    sections = [f.name for f in msgspec.structs.fields(Settings)]
    out: dict[str, dict[str, Any]] = {}
    for name, text in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        section, sep, key = name[len(ENV_PREFIX) :].lower().partition("__")
        if not sep and not any(section == s or section.startswith(f"{s}_") for s in sections):
            continue
        kind = _field_type(section, key) if sep else None
        if kind is None:
            raise SettingsError(
                f"{name}: no such setting; the form is MLXD_<SECTION>__<KEY>, "
                "e.g. MLXD_SERVER__PORT=9000 for [server] port"
            )
        out.setdefault(section, {})[key] = _env_value(name, text, kind)
    return out


def load_settings(
    path: Path | None = None,
    overrides: dict[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Defaults from config/default.toml, then the user's file, then ``MLXD_*`` variables from
    ``environ`` (the caller passes ``os.environ``; none by default), then CLI overrides."""
    raw = _read_toml(DEFAULT_CONFIG)
    if path is not None:
        raw = _merge(raw, _read_toml(path))
    if environ is not None:
        raw = _merge(raw, env_overrides(environ))
    raw = _merge(raw, overrides or {})
    try:
        return msgspec.convert(raw, type=Settings)
    except msgspec.ValidationError as exc:
        layers = [str(path or DEFAULT_CONFIG), *["environment"] * (environ is not None), "flags"]
        raise SettingsError(f"invalid setting ({' + '.join(layers)}): {exc}") from exc
