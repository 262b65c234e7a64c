"""LoRA adapters chosen per request (issue 44), the daemon's side: served ids that resolve
to a base model plus an ``AdapterRef``, checked against the base's linear layers before
their first request; their listings (``/v1/models``, ``/api/tags``, ``/v1/status``, the
dashboard); vLLM's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

Over scripted fake runners whose ``ModelInfo`` names the linear layers an adapter may
target; the adapters are real directories (mlx-lm's and PEFT's files, zeros for weights)
read by ``actors/engine/adapters/files.py``. The engine's own use of an adapter (its
weights in the batch) is tested with the engine."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import msgspec
import pytest
from mlxd.actors.engine.adapters import files
from mlxd.actors.engine.scheduler.types import ModelInfo
from mlxd.daemon.settings import load_settings
from mlxd.protocol.messages import AdapterRef, TokenizedRequest, UnloadAdapter

from tests.fakes import FakeRunner
from tests.test_models_multi import CHAT, FakeModel, ask, served

TARGETS = {
    "model.layers.0.self_attn.q_proj": (64, 64),
    "model.layers.0.mlp.down_proj": (128, 64),
}
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def safetensors(path: Path, shapes: dict[str, list[int]]) -> None:
    """A float32 safetensors file of zeros with these tensors."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * shape[0] * shape[1] if len(shape) == 2 else 4 * shape[0]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def mlx_adapter(path: Path, modules: dict[str, tuple[int, int]] = TARGETS, rank: int = 4) -> Path:
    """An mlx-lm adapter directory (``adapters.safetensors``: A [in, r], B [r, out])."""
    path.mkdir(parents=True, exist_ok=True)
    shapes = {}
    for module, (n_in, n_out) in modules.items():
        shapes[f"{module}.lora_a"] = [n_in, rank]
        shapes[f"{module}.lora_b"] = [rank, n_out]
    safetensors(path / files.MLX_WEIGHTS, shapes)
    config = {"fine_tune_type": "lora", "lora_parameters": {"rank": rank, "scale": 2.0}}
    (path / files.CONFIG).write_text(json.dumps(config))
    return path


def peft_adapter(path: Path, modules: dict[str, tuple[int, int]] = TARGETS, rank: int = 4) -> Path:
    """A PEFT adapter directory (``adapter_model.safetensors``: A [r, in], B [out, r])."""
    path.mkdir(parents=True, exist_ok=True)
    shapes = {}
    for module, (n_in, n_out) in modules.items():
        shapes[f"base_model.model.{module}.lora_A.weight"] = [rank, n_in]
        shapes[f"base_model.model.{module}.lora_B.weight"] = [n_out, rank]
    safetensors(path / files.PEFT_WEIGHTS, shapes)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8}
    (path / files.CONFIG).write_text(json.dumps(config))
    return path


class RecordingRunner(FakeRunner):
    """Remembers the model and adapter of each request it starts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started: dict[str, TokenizedRequest] = {}

    def start(self, request: TokenizedRequest) -> int:
        self.started[request.request_id] = request
        return super().start(request)


@dataclasses.dataclass
class LoraModel(FakeModel):
    """A fake base model that takes adapters on ``targets`` (unless ``refused`` says why)."""

    runner: FakeRunner = dataclasses.field(default_factory=RecordingRunner)
    targets: dict[str, tuple[int, int]] = dataclasses.field(default_factory=lambda: dict(TARGETS))
    refused: str = ""

    def __call__(self) -> tuple[FakeRunner, ModelInfo]:
        runner, info = super().__call__()
        info = dataclasses.replace(info, lora_targets=self.targets, adapters_refused=self.refused)
        return runner, info


def settings(*entries: dict, api_keys: list[str] | None = None, **model):
    raw = msgspec.to_builtins(load_settings())
    raw["models"] = list(entries)
    raw["model"].update(model)
    raw["auth"]["api_keys"] = api_keys or []
    return msgspec.convert(raw, type=type(load_settings()))


async def chat(c, model: str, text: str = "hi", **headers):
    r = await c.post(CHAT, json=ask(model, text), headers=headers)
    return r.status_code, json.loads(await r.get_data()), r.headers


class Recorder:
    """The engine's inbox, remembering what the routes send it."""

    def __init__(self, channel):
        self.channel, self.sent = channel, []

    async def send(self, message) -> None:
        self.sent.append(message)
        await self.channel.send(message)


# ---- settings and routing --------------------------------------------------------------------


async def test_an_adapter_id_is_served_by_its_base_with_the_adapter(tmp_path):
    sql, peft = mlx_adapter(tmp_path / "sql"), peft_adapter(tmp_path / "peft")
    base = LoraModel()
    s = settings({"id": "base", "adapters": {"sql": str(sql), "peft": str(peft)}})
    async with served(s, {"base": base}) as (c, pipeline):
        models = pipeline.models
        assert models.find("sql") == "sql" and models.base_of("sql") == "base"
        status, body, headers = await chat(c, "sql", "hello")
        assert status == 200, body
        assert body["model"] == "sql" and headers["mlxd-model"] == "sql"  # the id asked for
        assert body["choices"][0]["message"]["content"] == "HELLO"  # the base's template
        assert (await chat(c, "peft"))[0] == 200
        assert (await chat(c, "base"))[0] == 200
    by_text = {r.model: r.adapter for r in base.runner.started.values()}
    assert set(by_text) == {"base"}  # every request went to the base
    refs = [r.adapter for r in base.runner.started.values()]
    assert refs[0] == AdapterRef(name="sql", path=str(sql), fingerprint=files.fingerprint(sql))
    assert refs[1].name == "peft" and refs[1].path == str(peft) and refs[2] is None
    assert models.adapters["sql"].state == "ready"
    assert models.adapters["sql"].nbytes == files.inspect(sql).nbytes


def test_the_registry_refuses_an_adapter_named_as_the_one_model_s_own_id():
    import trio
    from mlxd.actors.mailbox import Mailboxes
    from mlxd.actors.models import ModelRegistry, RegistryOptions

    engine, _ = trio.open_memory_channel(1)
    with pytest.raises(ValueError, match="'m' .*is a model's id"):
        ModelRegistry(
            ["m"], engine, Mailboxes(), {}, RegistryOptions(), adapters={"m": {"m": "/x"}}
        )


async def test_a_mismatched_adapter_fails_its_requests_and_the_others_serve_on(tmp_path):
    good = mlx_adapter(tmp_path / "good")
    wide = {"model.layers.0.self_attn.q_proj": (64, 96)}
    bad = mlx_adapter(tmp_path / "bad", wide)
    alien = mlx_adapter(tmp_path / "alien", {"transformer.h.0.attn.c_attn": (64, 64)})
    base = LoraModel()
    table = {"good": str(good), "bad": str(bad), "alien": str(alien)}
    async with served(settings({"id": "base", "adapters": table}), {"base": base}) as (c, _):
        status, body, _ = await chat(c, "bad")
        assert status == 400, body
        error = body["error"]
        assert (error["type"], error["param"]) == ("invalid_request_error", "model")
        assert "'bad'" in error["message"]
        assert "model.layers.0.self_attn.q_proj" in error["message"]
        assert "64 → 96" in error["message"] and "64 → 64" in error["message"]
        status, body, _ = await chat(c, "alien")
        assert status == 400 and "transformer.h.0.attn.c_attn" in body["error"]["message"]
        assert (await chat(c, "base"))[0] == 200
        assert (await chat(c, "good"))[0] == 200
        assert (await chat(c, "bad"))[0] == 400  # the cached verdict
        cards = {
            m["id"]: m for m in json.loads(await (await c.get("/v1/models")).get_data())["data"]
        }
        assert cards["bad"]["status"] == "failed" and "64 → 96" in cards["bad"]["error"]
        assert cards["good"]["status"] == "loaded" and cards["good"]["error"] is None
        # the files fixed in place (a new fingerprint): checked again, and served
        mlx_adapter(bad)
        assert (await chat(c, "bad"))[0] == 200
    assert {r.adapter.name if r.adapter else None for r in base.runner.started.values()} == {
        None,
        "good",
        "bad",
    }


async def test_a_model_that_takes_no_adapters_says_why(tmp_path):
    sql = mlx_adapter(tmp_path / "sql")
    base = LoraModel(targets={}, refused="speculative decoding is on (speculative.enabled)")
    async with served(settings({"id": "base", "adapters": {"sql": str(sql)}}), {"base": base}) as (
        c,
        _,
    ):
        status, body, _ = await chat(c, "sql")
        assert status == 400
        assert "'sql'" in body["error"]["message"]
        assert "speculative decoding is on" in body["error"]["message"]
        assert (await chat(c, "base"))[0] == 200


async def test_an_unknown_id_is_a_404_naming_the_adapters_too(tmp_path):
    sql = mlx_adapter(tmp_path / "sql")
    s = settings({"id": "base", "adapters": {"sql": str(sql)}}, {"id": "other"})
    async with served(s, {"base": LoraModel(), "other": LoraModel()}) as (c, _):
        status, body, _ = await chat(c, "nope")
        assert status == 404 and "'sql'" in body["error"]["message"]


# ---- listings -----------------------------------------------------------------------------


async def test_adapters_are_listed_with_their_base(tmp_path):
    sql = mlx_adapter(tmp_path / "sql")
    s = settings({"id": "base", "adapters": {"sql": str(sql)}}, {"id": "other"})
    async with served(s, {"base": LoraModel(), "other": LoraModel()}) as (c, _):
        assert (await chat(c, "sql"))[0] == 200
        listed = json.loads(await (await c.get("/v1/models")).get_data())["data"]
        card = json.loads(await (await c.get("/v1/models/sql")).get_data())
        tags = json.loads(await (await c.get("/api/tags")).get_data())["models"]
        show = await c.post("/api/show", json={"model": "sql"})
        status = json.loads(await (await c.get("/v1/status")).get_data())
        view = json.loads(await (await c.get("/v1/dashboard")).get_data())
    assert [m["id"] for m in listed] == ["base", "other", "sql"]
    assert card == {
        "id": "sql",
        "created": 0,
        "owned_by": "mlxd",
        "object": "model",
        "status": "loaded",
        "parent": "base",
        "root": str(sql),
        "error": None,
    }
    assert "parent" not in listed[0]  # a model's card is as before
    assert [t["name"] for t in tags] == ["base", "other", "sql"]
    assert tags[2]["details"]["parent_model"] == "base" and tags[0]["details"]["parent_model"] == ""
    assert tags[2]["size"] == files.inspect(sql).nbytes
    shown = json.loads(await show.get_data())
    assert shown["details"]["parent_model"] == "base" and f"ADAPTER {sql}" in shown["modelfile"]
    (adapter,) = status["adapters"]
    assert adapter == {
        "id": "sql",
        "base": "base",
        "path": str(sql),
        "source": "settings",
        "state": "loaded",
        "error": "",
        "bytes": files.inspect(sql).nbytes,
    }
    rows = [(m["id"], m["parent"]) for m in view["models"]]
    assert rows == [("base", ""), ("sql", "base"), ("other", "")]  # each under its base
    assert view["models"][1]["finished_requests"] == 1


# ---- POST /v1/load_lora_adapter and /v1/unload_lora_adapter --------------------------------


async def test_load_then_use_then_unload_an_adapter(tmp_path):
    sql = peft_adapter(tmp_path / "sql")
    base = LoraModel()
    async with served(
        settings({"id": "base"}, {"id": "other"}), {"base": base, "other": LoraModel()}
    ) as (
        c,
        pipeline,
    ):
        pipeline.engine = recorder = Recorder(pipeline.engine)
        assert (await chat(c, "sql"))[0] == 404
        body = {"lora_name": "sql", "lora_path": str(sql), "base_model_name": "base"}
        r = await c.post(LOAD, json=body)
        assert r.status_code == 200
        assert (await r.get_data()).decode() == "Success: LoRA adapter 'sql' added successfully."
        assert base.loads == 1  # the base loaded to check the files against
        status, answer, _ = await chat(c, "sql")
        assert status == 200 and answer["model"] == "sql"
        assert pipeline.models.adapters["sql"].source == "api"
        r = await c.post(UNLOAD, json={"lora_name": "sql"})
        assert r.status_code == 200
        assert (await r.get_data()).decode() == "Success: LoRA adapter 'sql' removed successfully."
        assert UnloadAdapter(model="base", name="sql") in recorder.sent
        assert (await chat(c, "sql"))[0] == 404
        listed = json.loads(await (await c.get("/v1/models")).get_data())["data"]
        assert [m["id"] for m in listed] == ["base", "other"]
        r = await c.post(UNLOAD, json={"lora_name": "sql"})
        assert r.status_code == 404
        assert json.loads(await r.get_data())["error"]["param"] == "lora_name"
    assert [r.adapter.name for r in base.runner.started.values() if r.adapter] == ["sql"]


async def test_the_default_model_is_the_base_when_none_is_named(tmp_path):
    sql = mlx_adapter(tmp_path / "sql")
    async with served(settings({"id": "base"}), {"base": LoraModel()}) as (c, pipeline):
        r = await c.post(LOAD, json={"lora_name": "sql", "lora_path": str(sql)})
        assert r.status_code == 200
        assert pipeline.models.adapters["sql"].base == "base"


async def test_an_adapter_from_the_settings_unloads_too(tmp_path):
    sql = mlx_adapter(tmp_path / "sql")
    async with served(
        settings({"id": "base", "adapters": {"sql": str(sql)}}), {"base": LoraModel()}
    ) as (
        c,
        pipeline,
    ):
        pipeline.engine = recorder = Recorder(pipeline.engine)
        assert (await c.post(UNLOAD, json={"lora_name": "sql"})).status_code == 200
        assert recorder.sent == [UnloadAdapter(model="base", name="sql")]
        assert (await chat(c, "sql"))[0] == 404


async def test_an_unloaded_adapter_is_a_404_even_where_other_ids_are_aliases(tmp_path):
    sql = mlx_adapter(tmp_path / "sql")
    s = settings({"id": "base", "adapters": {"sql": str(sql)}}, accept_other_ids=True)
    async with served(s, {"base": LoraModel()}) as (c, _):
        assert (await chat(c, "gpt-4o"))[0] == 200  # an alias of the first model
        assert (await c.post(UNLOAD, json={"lora_name": "sql"})).status_code == 200
        assert (await chat(c, "sql"))[0] == 404
        body = {"lora_name": "sql", "lora_path": str(sql)}
        assert (await c.post(LOAD, json=body)).status_code == 200  # served again
        assert (await chat(c, "sql"))[0] == 200


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"lora_name": "base", "lora_path": "GOOD"}, 400, "lora_name", "already a served"),
        ({"lora_name": "sql", "lora_path": "GOOD"}, 400, "lora_name", "already a served"),
        ({"lora_name": "", "lora_path": "GOOD"}, 400, "lora_name", "empty"),
        ({"lora_name": "x", "lora_path": ""}, 400, "lora_path", "empty"),
        ({"lora_name": "x", "lora_path": "MISSING"}, 400, "lora_path", "not a directory"),
        ({"lora_name": "x", "lora_path": "EMPTY"}, 400, "lora_path", "adapter_config.json"),
        ({"lora_name": "x", "lora_path": "WIDE"}, 400, "lora_path", "64 → 96"),
        (
            {"lora_name": "x", "lora_path": "GOOD", "base_model_name": "nope"},
            404,
            "base_model_name",
            "'nope'",
        ),
        (
            {"lora_name": "x", "lora_path": "GOOD", "base_model_name": "embed"},
            400,
            "base_model_name",
            "embedding",
        ),
        ({"lora_name": "x"}, 400, None, "lora_path"),
    ],
)
async def test_a_load_that_cannot_serve_is_refused(tmp_path, body, status, param, words):
    paths = {
        "GOOD": mlx_adapter(tmp_path / "good"),
        "MISSING": tmp_path / "missing",
        "EMPTY": tmp_path,
        "WIDE": mlx_adapter(tmp_path / "wide", {"model.layers.0.self_attn.q_proj": (64, 96)}),
    }
    body = {k: str(paths.get(v, v)) for k, v in body.items()}
    s = settings(
        {"id": "base", "adapters": {"sql": str(paths["GOOD"])}},
        {"id": "embed", "kind": "embedding"},
    )
    async with served(s, {"base": LoraModel(), "embed": LoraModel()}) as (c, pipeline):
        r = await c.post(LOAD, json=body)
        answer = json.loads(await r.get_data())
        assert r.status_code == status, answer
        assert answer["error"]["param"] == param and words in answer["error"]["message"]
        assert set(pipeline.models.adapters) == {"sql"}  # nothing registered


async def test_the_adapter_routes_need_the_api_key(tmp_path):
    sql = mlx_adapter(tmp_path / "sql")
    s = settings({"id": "base"}, api_keys=["k"])
    async with served(s, {"base": LoraModel()}) as (c, pipeline):
        body = {"lora_name": "sql", "lora_path": str(sql)}
        assert (await c.post(LOAD, json=body)).status_code == 401
        assert (await c.post(UNLOAD, json={"lora_name": "sql"})).status_code == 401
        assert not pipeline.models.adapters
        auth = {"Authorization": "Bearer k"}
        assert (await c.post(LOAD, json=body, headers=auth)).status_code == 200
        assert (await c.post(UNLOAD, json={"lora_name": "sql"}, headers=auth)).status_code == 200


# ---- a real tiny model -------------------------------------------------------------------------


@pytest.mark.mlx
async def test_a_real_model_serves_a_fitting_adapter_and_refuses_a_mismatched_one(
    tiny_models, tmp_path
):
    """The tiny random llama's own linear layers (``ModelInfo.lora_targets`` from its
    runner) against an mlx-lm adapter trained for it and one made for other shapes."""
    import trio
    from mlxd.daemon.app import create_app
    from mlxd.daemon.supervisor import open_graph, run_actors

    from tests.test_lora import make_adapter

    model_dir = tiny_models("llama")
    good = make_adapter(model_dir, tmp_path / "good")
    bad = mlx_adapter(tmp_path / "bad", {"model.layers.0.self_attn.q_proj": (7, 9)})
    raw = msgspec.to_builtins(load_settings())
    raw["model"]["cache_dir"] = str(tmp_path)
    raw["prefix_cache"]["enabled"] = False
    raw["models"] = [
        {"id": "base", "path": str(model_dir), "adapters": {"good": str(good), "bad": str(bad)}}
    ]
    s = msgspec.convert(raw, type=type(load_settings()))
    body = {"prompt": [1, 42, 7, 300], "max_tokens": 3, "temperature": 0}
    graph = open_graph(s)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, s, None)
        c = create_app(graph.pipeline, s).test_client()
        answers = {}
        for model in ("bad", "base", "good"):
            r = await c.post("/v1/completions", json={**body, "model": model})
            answers[model] = (r.status_code, json.loads(await r.get_data()))
        nursery.cancel_scope.cancel()
    status, error = answers["bad"]
    assert status == 400 and "model.layers.0.self_attn.q_proj" in error["error"]["message"]
    assert "7 → 9" in error["error"]["message"]
    assert answers["base"][0] == 200
    assert answers["good"][0] == 200 and answers["good"][1]["model"] == "good"
    assert graph.pipeline.models.adapters["good"].state == "ready"
