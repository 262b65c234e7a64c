"""scripts/bench_tools.py without a model: BFCL's dialect as JSON Schema, the official AST
checker behind its configuration stub, and the scoring of answers."""

from __future__ import annotations

import sys

import jsonschema
import pytest
from mlxd.scripts import bench_tools as bt


def test_the_dialect_becomes_json_schema() -> None:
    bfcl = {
        "type": "dict",
        "properties": {
            "ratio": {"type": "float", "description": "r", "optional": True},
            "point": {"type": "tuple", "items": {"type": "float"}},
            "data": {"type": "any"},
            "rows": {
                "type": "array",
                "items": {"type": "dict", "properties": {"on": {"type": "bool"}}},
            },
        },
        "required": ["ratio"],
    }
    assert bt.json_schema(bfcl) == {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "description": "r"},
            "point": {"type": "array", "items": {"type": "number"}},
            "data": {},
            "rows": {
                "type": "array",
                "items": {"type": "object", "properties": {"on": {"type": "boolean"}}},
            },
        },
        "required": ["ratio"],
    }


def test_tools_take_openai_names_and_strict() -> None:
    fn = {"name": "math.factorial", "description": "n!", "parameters": {"type": "dict"}}
    (tool,) = bt.tools([fn], strict=False)
    assert tool["function"]["name"] == "math_factorial"
    assert tool["function"]["parameters"] == {"type": "object"}
    assert tool["function"]["strict"] is False
    assert "strict" not in bt.tools([fn])[0]["function"]


def _first(options: dict, required: tuple[str, ...] = ()) -> dict:
    """The first accepted value of each key, left out where "" (may be left out) is accepted
    and the schema does not require it (a few answers list "" for a required parameter); a
    dict's accepted values, also inside a list, are a dict of options again."""
    out = {}
    for key, values in options.items():
        given = [v for v in values if v != ""]
        if given and (key in required or len(given) == len(values)):
            out[key] = _value(given[0])
    return out


def _value(value):
    if isinstance(value, dict):
        return _first(value)
    if isinstance(value, list):
        return [_value(v) for v in value]
    return value


def _ground_truth_call(case: bt.Case) -> list[dict]:
    required = {f["name"]: tuple(f["parameters"].get("required", ())) for f in case.functions}
    calls = []
    for expected in case.answer:
        ((name, params),) = expected.items()
        calls.append({bt.openai_name(name): _first(params, required[name])})
    return calls


@pytest.mark.parametrize("category", bt.CATEGORIES)
def test_every_ground_truth_validates_and_passes_the_official_checker(category: str) -> None:
    check = bt.checker()
    for case in bt.cases(category, limit=400):
        schemas = {
            t["function"]["name"]: t["function"]["parameters"] for t in bt.tools(case.functions)
        }
        for schema in schemas.values():
            jsonschema.Draft202012Validator.check_schema(schema)
        output = _ground_truth_call(case)
        for call in output:
            ((name, args),) = call.items()
            assert bt.valid_call(name, args, schemas), (case.id, call)
        assert check(case, output)["valid"], case.id


def test_the_checker_runs_without_the_model_handlers() -> None:
    check = bt.checker()
    assert "bfcl_eval.model_handler" not in sys.modules
    (case,) = [c for c in bt.cases("simple_python", 5) if c.id == "simple_python_1"]
    assert case.functions[0]["name"] == "math.factorial"
    assert check(case, [{"math_factorial": {"number": 5}}])["valid"]
    assert not check(case, [{"math_factorial": {"number": 6}}])["valid"]
    assert not check(case, [{"math.factorial": {"number": 5}}])["valid"]


def test_score_counts_calls_valid_arguments_and_markup_left_in_content() -> None:
    check = bt.checker()
    (case,) = [c for c in bt.cases("simple_python", 5) if c.id == "simple_python_1"]
    good = bt.Answer(case.id, calls=[("math_factorial", '{"number": 5}')])
    typed_wrong = bt.Answer(case.id, calls=[("math_factorial", '{"number": "5"}')])
    in_text = bt.Answer(case.id, content='<tool_call>{"name": "math_factorial", "arguments": {}}')
    as_code = bt.Answer(
        case.id, content="def math_factorial(n):\n    return n * math_factorial(n - 1)"
    )
    scored = [bt.score(case, a, check) for a in (good, typed_wrong, in_text, as_code)]
    assert [(s["calls"], s["valid"], s["ast"], s["in_content"]) for s in scored] == [
        (1, 1, True, False),
        (1, 0, False, False),
        (0, 0, False, True),
        (0, 0, False, False),
    ]
    row = bt.summary(scored)
    assert row["parsed_call"] == 0.5
    assert row["valid_args"] == 0.5
    assert row["ast_accuracy"] == 0.25
    assert row["call_in_content"] == 0.25


def test_an_answer_is_read_from_a_chat_completion() -> None:
    response = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "content": None,
                    "tool_calls": [{"function": {"name": "f", "arguments": '{"a": 1}'}}],
                },
            }
        ]
    }
    answer = bt.answer_of("x", response)
    assert answer.calls == [("f", '{"a": 1}')]
    assert answer.content == ""
    assert answer.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("content", "left"),
    [
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', True),
        ("<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>", True),
        ('[TOOL_CALLS][{"name": "f", "arguments": {}}]', True),
        ('Calling {"name": "f", "arguments": {"a": 1}} now.', True),
        ("signatures within <tool_call></tool_call> XML tags:", False),
        ("def f(a):\n    return f(a - 1)", False),
    ],
)
def test_a_call_left_in_content_is_an_opener_with_a_body(content: str, left: bool) -> None:
    assert bt.call_in_content(content) is left


def test_a_dump_scores_again_to_the_same_rows(tmp_path) -> None:
    check = bt.checker()
    todo = bt.cases("simple_python", 2)
    said = [
        bt.Answer(todo[0].id, calls=[("calculate_triangle_area", '{"base": 10, "height": 5}')]),
        bt.Answer(todo[1].id, content="<tool_call>\n{", finish_reason="length"),
    ]
    scored = [bt.score(c, a, check) for c, a in zip(todo, said, strict=True)]
    dump = tmp_path / "answers.jsonl"
    bt._dump(dump, "m", "mlxd", todo, said, scored)
    (row,) = bt.rescore(dump, check)
    assert row == {"model": "m", "category": "simple_python", "arm": "mlxd", **bt.summary(scored)}
    assert (row["parsed_call"], row["ast_accuracy"], row["call_in_content"]) == (0.5, 0.5, 0.5)
