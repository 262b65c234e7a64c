"""Structured-output JSON has a fixed layout: ``, `` and ``: `` between tokens and no other
whitespace, so a model cannot spend its answer on ``{\\n \\t\\r\\n ...`` (``JSON_LAYOUT`` in
``actors/grammar.py``)."""

from __future__ import annotations

import json

import llguidance
import msgspec
import pytest
import trio
from mlxd.actors.grammar import GrammarCompiler, _byte_tokenizer
from mlxd.daemon.app import create_app
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import open_graph, run_actors
from mlxd.protocol.messages import Constraint

# No free strings or numbers: every answer the grammar allows is a few tokens long.
CHOICE = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["x", "y"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


def accepts(constraint: Constraint, text: str) -> bool:
    grammar = GrammarCompiler(None).grammar_text(constraint, (), "hermes")
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


@pytest.mark.parametrize(
    "constraint",
    [Constraint(kind="json_object"), Constraint(kind="json_schema", schema=CHOICE)],
)
def test_only_the_fixed_separators_are_allowed(constraint):
    assert accepts(constraint, '{"ok": true, "pick": "x"}')
    for spaced in (
        ' {"ok": true, "pick": "x"}',
        '{ "ok": true, "pick": "x"}',
        '{"ok":  true, "pick": "x"}',
        '{"ok": true,\n "pick": "x"}',
        '{"ok": true, "pick": "x"}\n',
        '{"ok":true,"pick":"x"}',
    ):
        assert not accepts(constraint, spaced), spaced


def test_a_schema_may_ask_for_its_own_layout():
    """llguidance's ``x-guidance`` options in the schema win over the default layout."""
    free = {"whitespace_flexible": True, "item_separator": ",", "key_separator": ":"}
    loose = {**CHOICE, "x-guidance": free}
    assert accepts(Constraint(kind="json_schema", schema=loose), '{\n  "ok": true,\n  "pick": "x"}')


@pytest.mark.mlx
async def test_a_model_pushed_towards_whitespace_still_writes_compact_json(tiny_models, tmp_path):
    """Every whitespace-only token biased by +100: with llguidance's default (free whitespace
    between tokens) the tiny model writes nothing but whitespace until max_tokens; with the
    fixed layout it can only write the object."""
    from transformers import AutoTokenizer

    model_dir = tiny_models("llama")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    spaces = [i for i in range(len(tokenizer)) if tokenizer.decode([i]).isspace()]
    assert spaces
    raw = msgspec.to_builtins(load_settings())
    raw["model"].update(path=str(model_dir), cache_dir=str(tmp_path))
    settings = msgspec.convert(raw, type=type(load_settings()))
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": CHOICE}}
    body = {
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "response_format": fmt,
        "logit_bias": {str(i): 100 for i in spaces[: settings.engine.max_logit_bias]},
        "temperature": 0,
        "max_tokens": 60,
    }
    graph = open_graph(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, None)
        c = create_app(graph.pipeline, settings).test_client()
        r = await c.post("/v1/chat/completions", json=body)
        nursery.cancel_scope.cancel()
    assert r.status_code == 200, await r.get_data()
    choice = json.loads(await r.get_data())["choices"][0]
    assert choice["finish_reason"] == "stop"
    content = choice["message"]["content"]
    value = json.loads(content)
    assert set(value) == {"ok", "pick"}
    assert content == json.dumps(value)  # json.dumps' own layout: ", " and ": " only
