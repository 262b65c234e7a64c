"""The typed settings tree, decoded from ``config/default.toml`` plus an optional user file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "config" / "default.toml"


Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
Positive = Annotated[int, msgspec.Meta(ge=1)]


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class ServerSettings(_Section):
    host: str = "127.0.0.1"
    port: Port = 8000
    max_body_bytes: Positive = 4_194_304
    drain_timeout_s: float = 30.0
    flush_timeout_s: float = 5.0


class ModelSettings(_Section):
    path: str = ""
    served_id: str = ""
    accept_other_ids: bool = False
    cache_dir: str = "~/.cache/mlxd"
    dequantize_on_cpu: bool = True


class AdmissionSettings(_Section):
    max_running: Positive = 32
    max_waiting: int = 64
    retry_after_s: int = 1


class TokenizerSettings(_Section):
    workers: Positive = 2
    max_messages: Positive = 1000
    tool_format: str = "auto"
    reasoning_tags: str = "auto"


class EngineSettings(_Section):
    max_batch: Positive = 32
    prefill_chunk_tokens: Positive = 512
    default_max_tokens: Positive = 512
    max_tokens_cap: Positive = 4096
    max_prompt_tokens: int = 0
    max_stop_strings: int = 16
    max_stop_length: int = 256
    max_n: Positive = 8
    max_top_logprobs: int = 20


class StreamingSettings(_Section):
    engine_outbox: Positive = 4


class LoggingSettings(_Section):
    level: str = "INFO"


class Settings(_Section):
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    model: ModelSettings = msgspec.field(default_factory=ModelSettings)
    admission: AdmissionSettings = msgspec.field(default_factory=AdmissionSettings)
    tokenizer: TokenizerSettings = msgspec.field(default_factory=TokenizerSettings)
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    streaming: StreamingSettings = msgspec.field(default_factory=StreamingSettings)
    logging: LoggingSettings = msgspec.field(default_factory=LoggingSettings)


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


def load_settings(path: Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Defaults from config/default.toml, then the user's file, then CLI overrides."""
    raw = _read_toml(DEFAULT_CONFIG)
    if path is not None:
        raw = _merge(raw, _read_toml(path))
    raw = _merge(raw, overrides or {})
    try:
        return msgspec.convert(raw, type=Settings)
    except msgspec.ValidationError as exc:
        raise SettingsError(
            f"invalid setting ({path or DEFAULT_CONFIG} + command line): {exc}"
        ) from exc
