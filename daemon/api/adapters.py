"""vLLM's LoRA adapter routes: ``POST /v1/load_lora_adapter`` serves an adapter directory
over a base model under a new id, once its files are checked against the base's linear
layers (the base is loaded for that); ``POST /v1/unload_lora_adapter`` stops serving one
(from the settings or loaded here) and tells the engine, which drops its weights once no
running request uses them. Both answer as vLLM does (a line of text); errors are
OpenAI's: a taken id or a directory that cannot serve the base is a 400, an unknown
base or adapter a 404."""

from __future__ import annotations

import uuid

import msgspec
import trio
from mlxd.actors.tokenizer import ModelUnavailable
from mlxd.daemon.api.common import Validator, check
from mlxd.daemon.api.errors import ApiError
from mlxd.daemon.pipeline import Pipeline, ServerState
from mlxd.protocol.messages import Abort, UnloadAdapter
from quart import Response, request
from quart_trio import QuartTrio


class LoadLoraAdapter(msgspec.Struct, kw_only=True):
    """``POST /v1/load_lora_adapter``'s body (vLLM's); ``base_model_name``: the served model
    it adapts (none: the default model)."""

    lora_name: str
    lora_path: str
    base_model_name: str | None = None


class UnloadLoraAdapter(msgspec.Struct, kw_only=True):
    """``POST /v1/unload_lora_adapter``'s body (vLLM's ``lora_int_id`` is ignored)."""

    lora_name: str
    lora_int_id: int | None = None


_load = msgspec.json.Decoder(LoadLoraAdapter)
_unload = msgspec.json.Decoder(UnloadLoraAdapter)


def _text(message: str) -> Response:
    return Response(message, content_type="text/plain; charset=utf-8")


def install(app: QuartTrio, pipeline: Pipeline, validator: Validator) -> None:
    def registry():
        models = pipeline.models
        if pipeline.state is not ServerState.READY or models is None:
            raise ApiError("not_ready", f"server is {pipeline.state.value}", retry_after=1)
        return models

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter() -> Response:
        body = validator.decode(_load, await request.get_data(cache=False))
        models = registry()
        name, path = body.lora_name, body.lora_path
        check(name.strip() == name != "", "lora_name", "lora_name: an empty or padded id")
        check(path.strip() != "", "lora_path", "lora_path: empty")
        check(
            not models.adapter_id_taken(name),
            "lora_name",
            f"{name!r} is already a served model or adapter id (unload it first)",
        )
        base = body.base_model_name or models.default
        if base not in models.entries:  # an exact id: an alias would adapt another model
            served = ", ".join(repr(m) for m in models.entries)
            raise ApiError(
                "model_not_found",
                f"base model {base!r} not found; this server serves {served}",
                param="base_model_name",
            )
        check(
            models.entries[base].kind != "embedding",
            "base_model_name",
            f"model {base!r} is an embedding model: it takes no LoRA adapters",
        )
        pin = f"lora-load-{uuid.uuid4().hex}"  # keeps the base loaded until the Abort below
        try:
            await models.add_adapter(name, path, base, pin)
        except ModelUnavailable as exc:
            f = exc.failed
            param = "lora_path" if f.reason == "invalid_request" else None
            raise ApiError(f.reason, f.message, param=param, retry_after=f.retry_after) from None
        except ValueError as exc:  # another load took the name meanwhile
            raise ApiError("invalid_request", str(exc), param="lora_name") from None
        finally:
            with trio.CancelScope(shield=True):
                await pipeline.engine.send(Abort(request_id=pin))
        return _text(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter() -> Response:
        body = validator.decode(_unload, await request.get_data(cache=False))
        models = registry()
        adapter = models.remove_adapter(body.lora_name)
        if adapter is None:
            served = ", ".join(repr(a) for a in models.adapters) or "none"
            raise ApiError(
                "model_not_found",
                f"LoRA adapter {body.lora_name!r} not found; served adapters: {served}",
                param="lora_name",
            )
        await pipeline.engine.send(UnloadAdapter(model=adapter.base, name=adapter.name))
        return _text(f"Success: LoRA adapter '{adapter.name}' removed successfully.")
