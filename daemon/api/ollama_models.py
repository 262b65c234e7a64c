"""Ollama's model routes: ``/api/tags``, ``/api/show`` and ``/api/ps`` (the served models as
Ollama lists them: details read from each model's config.json, the pool's unload time),
and loading a model with no prompt (``load``), which the chat, generate and embed
routes use too."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import trio
from mlxd.actors.tokenizer import ModelUnavailable
from mlxd.daemon.api.errors import ApiError
from mlxd.daemon.pipeline import Pipeline
from mlxd.protocol import ollama as wire
from mlxd.protocol.messages import Abort


def unavailable(exc: ModelUnavailable) -> ApiError:
    f = exc.failed
    return ApiError(f.reason, f.message, retry_after=f.retry_after)


async def load(pipeline: Pipeline, model: str) -> None:
    """Load ``model`` unless it is loaded (a 503 / 500 when it cannot be)."""
    rid = f"ollama-load-{uuid.uuid4().hex}"
    assert pipeline.models is not None
    try:  # pinned by the request id until the Abort
        await pipeline.models.loaded(model, rid)
    except ModelUnavailable as exc:
        raise unavailable(exc) from exc
    finally:
        with trio.CancelScope(shield=True):
            await pipeline.engine.send(Abort(request_id=rid))


def _config(model_dir: Path | None) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text()) if model_dir else {}
    except (OSError, ValueError):
        return {}


def _details(model_dir: Path | None, backend: str = "") -> wire.Details:
    config = _config(model_dir)
    family = str(config.get("model_type", ""))
    quant = config.get("quantization") or {}
    bits = quant.get("bits") if isinstance(quant, dict) else None
    return wire.Details(
        format="gguf" if backend == "gguf" else "safetensors",
        family=family,
        families=[family] if family else None,
        quantization_level=f"Q{bits}" if bits else str(config.get("torch_dtype", "")).upper(),
    )


def _digest(model: str, model_dir: Path | None) -> str:
    return hashlib.sha256(f"{model}\0{model_dir}".encode()).hexdigest()


def _modified(model_dir: Path | None) -> str:
    try:
        stamp = model_dir.stat().st_mtime if model_dir else time.time()
    except OSError:
        stamp = time.time()
    return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z")


def _expires(pipeline: Pipeline, model: str) -> str:
    """When the pool unloads an idle model (far in the future: never)."""
    at = pipeline.stats_of(model).expires_at
    moment = datetime.fromtimestamp(at, UTC) if at > 0 else datetime(2318, 1, 1, tzinfo=UTC)
    return moment.isoformat().replace("+00:00", "Z")


def tags(pipeline: Pipeline) -> wire.Tags:
    """The served models, then their LoRA adapters (``details.parent_model``: the base)."""
    models = pipeline.models
    assert models is not None
    listed = []
    for e in models.entries.values():
        model_dir = e.info.model_dir if e.info else None
        listed.append(
            wire.ListedModel(
                name=e.id,
                model=e.id,
                modified_at=_modified(model_dir),
                size=e.weights_bytes,
                digest=_digest(e.id, model_dir),
                details=_details(model_dir, e.info.backend if e.info else ""),
            )
        )
    for a in models.adapters.values():  # each LoRA adapter, naming its base
        base = models.entries[a.base]
        model_dir = base.info.model_dir if base.info else None
        details = _details(model_dir, base.info.backend if base.info else "")
        listed.append(
            wire.ListedModel(
                name=a.name,
                model=a.name,
                modified_at=_modified(Path(a.path)),
                size=a.nbytes,
                digest=_digest(a.name, Path(a.path)),
                details=msgspec.structs.replace(details, parent_model=a.base),
            )
        )
    return wire.Tags(models=listed)


def running(pipeline: Pipeline) -> wire.Running:
    assert pipeline.models is not None
    running = []
    for e in pipeline.models.entries.values():
        if e.state != "loaded" or e.info is None:
            continue
        running.append(
            wire.RunningModel(
                name=e.id,
                model=e.id,
                size=e.weights_bytes,
                digest=_digest(e.id, e.info.model_dir),
                details=_details(e.info.model_dir, e.info.backend),
                expires_at=_expires(pipeline, e.id),
                size_vram=e.weights_bytes,
                context_length=e.info.context_length,
            )
        )
    return wire.Running(models=running)


def _capabilities(kind: str, fills_middle: bool) -> list[str]:
    """Ollama's capabilities: "insert" where the model has FIM tokens (``suffix``)."""
    if kind == "embedding":
        return ["embedding"]
    extra = (["insert"] if fills_middle else []) + (["vision"] if kind == "vision" else [])
    return ["completion", "tools", *extra]


async def show(pipeline: Pipeline, model: str) -> wire.Show:
    """A model's card; it loads the model if need be (its files say what it is)."""
    assert pipeline.models is not None
    entry = pipeline.models.entries[pipeline.models.base_of(model)]  # an adapter's: its base's
    if entry.info is None:
        await load(pipeline, model)
    info = entry.info
    assert info is not None
    config = _config(info.model_dir)
    arch = str(config.get("model_type", "unknown"))
    model_info = {
        "general.architecture": arch,
        f"{arch}.context_length": info.context_length,
        "general.vocab_size": info.vocab_size,
    }
    template = getattr(info.tokenizer, "chat_template", None)
    fills_middle = False
    if info.kind != "embedding":  # its FIM layout is the prompt builder's (built once)
        fills_middle = (await pipeline.models.builder(entry)).fim.format is not None
    adapter = pipeline.models.adapters.get(model)
    details = _details(info.model_dir, info.backend)
    modelfile = f"# served by mlxd\nFROM {info.model_dir}\n"
    if adapter is not None:  # Ollama's Modelfile names a LoRA adapter with ADAPTER
        details = msgspec.structs.replace(details, parent_model=adapter.base)
        modelfile += f"ADAPTER {adapter.path}\n"
    return wire.Show(
        modelfile=modelfile,
        parameters="",
        template=template if isinstance(template, str) else "",
        details=details,
        model_info=model_info,
        capabilities=_capabilities(info.kind, fills_middle),
        modified_at=_modified(info.model_dir),
    )
