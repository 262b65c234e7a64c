"""BFCL: tool calls in ``tool_choice: auto``, scored by the Berkeley Function Calling
Leaderboard's own data and AST checker (PyPI ``bfcl-eval``, installed by ``scripts/install
--test`` without its dependencies).

Each case of a category (``simple_python``, ``multiple``, ``parallel``) is sent as one greedy
chat completion with its functions as OpenAI tools and ``tool_choice: "auto"``. BFCL writes
its functions in its own dialect (``dict``, ``float``, ``tuple``, ``any``); ``json_schema``
turns them into JSON Schema. OpenAI tool names cannot hold dots, so ``math.factorial`` is
offered as ``math_factorial``, and the checker, told the names are ``underscore_to_dot``,
maps the expected names the same way. Per model, category and arm the report gives:

- ``parsed_call``: the share of answers with at least one parsed call;
- ``valid_args``: the share of those calls whose arguments are a JSON object that validates
  against the tool's schema (jsonschema);
- ``ast_accuracy``: the share of answers the official AST checker accepts;
- ``call_in_content``: the share of answers whose content holds call markup;
- ``ran_on_after_call``: the share of answers with a call that went on until ``max_tokens``;
- ``over_one_call``: answers with more than one call where the request said
  ``parallel_tool_calls: false`` (every category but ``parallel``).

The arms are mlxd with auto-mode constraints (its default), mlxd without them (the setting
``OPT_OUT`` set off) and ``mlx_lm.server`` on the same model directory. Each server is
started as a subprocess (``bench_agents.serving``), given every category, and stopped.

    python -m mlxd.scripts.bench_tools                         # both models, 20 cases each
    python -m mlxd.scripts.bench_tools --models smollm2 --limit 3 --no-record
    python -m mlxd.scripts.bench_tools --answers /tmp/bfcl.jsonl  # every answer, scored
    python -m mlxd.scripts.bench_tools --rescore /tmp/bfcl.jsonl  # that dump's table again

The record goes to ``docs/results/bench_tools.jsonl`` (``scripts/records.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

CATEGORIES = ("simple_python", "multiple", "parallel")
MODELS = ("smollm2", "gemma3")
MODEL_NAMES = {"smollm2": "SmolLM2-135M", "gemma3": "Gemma 3 270M Q4_K_M (loaded as float32)"}
ARMS = ("constrained", "unconstrained", "mlx_lm")
# The setting that turns auto-mode constraints off: (section, key).
OPT_OUT = ("tokenizer", "constrain_auto_calls")
# The model name the checker's stubbed configuration knows (OpenAI-style tool names).
CHECKER_MODEL = "mlxd-bench"

# ---- BFCL's data and dialect ----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One BFCL question with the functions it offers and the answers the checker accepts."""

    id: str
    category: str
    messages: list[dict]
    functions: list[dict]
    answer: list[dict]


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def cases(category: str, limit: int) -> list[Case]:
    """The first ``limit`` cases of ``BFCL_v4_<category>``, joined with their answers."""
    data = resources.files("bfcl_eval") / "data"
    name = f"BFCL_v4_{category}.json"
    answers = {a["id"]: a["ground_truth"] for a in _jsonl(data / "possible_answer" / name)}
    out = []
    for entry in _jsonl(data / name)[:limit]:
        messages = entry["question"][0]  # single-turn categories: one turn
        out.append(Case(entry["id"], category, messages, entry["function"], answers[entry["id"]]))
    return out


# BFCL's Python-flavoured type names; ``any`` leaves the type open.
_TYPES: dict[str, str | None] = {
    "dict": "object",
    "float": "number",
    "tuple": "array",
    "list": "array",
    "bool": "boolean",
    "any": None,
}


def json_schema(node: dict) -> dict:
    """A BFCL parameter description as JSON Schema, nested ``properties`` and ``items`` too;
    BFCL's own ``optional`` flag (not a JSON Schema keyword) is dropped."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "type":
            mapped = _TYPES.get(value, value)
            if mapped is not None:
                out["type"] = mapped
        elif key == "properties":
            out["properties"] = {name: json_schema(sub) for name, sub in value.items()}
        elif key == "items":
            out["items"] = json_schema(value)
        elif key != "optional":
            out[key] = value
    return out


def openai_name(name: str) -> str:
    """OpenAI tool names match ``^[a-zA-Z0-9_-]{1,64}$``: BFCL's dots become underscores."""
    return name.replace(".", "_")


def tools(functions: list[dict], strict: bool | None = None) -> list[dict]:
    """BFCL functions as OpenAI chat tools (``strict`` on each when given)."""
    out = []
    for f in functions:
        fn = {
            "name": openai_name(f["name"]),
            "description": f.get("description", ""),
            "parameters": {**json_schema(f["parameters"]), "type": "object"},
        }
        if strict is not None:
            fn["strict"] = strict
        out.append({"type": "function", "function": fn})
    return out


# ---- the official checker ----------------------------------------------------------------------


def _model_config_stub() -> types.ModuleType:
    """``bfcl_eval.constants.model_config`` imports every model handler of the package (and
    so their SDKs); the checker reads one flag from it. This stub has the flag alone."""
    stub = types.ModuleType("bfcl_eval.constants.model_config")
    config = types.SimpleNamespace(underscore_to_dot=True)
    stub.MODEL_CONFIG_MAPPING = {CHECKER_MODEL: config}  # type: ignore[attr-defined]
    return stub


def checker() -> Callable[[Case, list[dict]], dict]:
    """The official AST checker, as ``check(case, [{name: arguments}, ...]) -> result``."""
    sys.modules.setdefault("bfcl_eval.constants.model_config", _model_config_stub())
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    def check(case: Case, output: list[dict]) -> dict:
        return ast_checker(
            case.functions, output, case.answer, Language.PYTHON, case.category, CHECKER_MODEL
        )

    return check


# ---- one answer, scored ------------------------------------------------------------------------


@dataclass
class Answer:
    """What a server said to one case: content, calls as (name, arguments text), or an error."""

    case_id: str
    content: str = ""
    calls: list[tuple[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


# A call left in content: a family's opener followed by a call body, or a JSON call object,
# that the server's parser should have taken out. Not a bare mention of the tags (Gemma
# echoes its system prompt's "within <tool_call></tool_call> XML tags"), nor Python that
# defines or calls the tool as code: those are prose.
_MARKUP = re.compile(
    r"<tool_call>\s*\{|<function[=>]|\[TOOL_CALLS\]|<\|python_tag\|>"
    r"|<start_function_call>|```tool_code"
    r"|\"(?:name|function)\"\s*:\s*\"[^\"]*\"\s*,\s*\"(?:arguments|parameters)\""
)


def call_in_content(content: str) -> bool:
    """Whether ``content`` holds a call's markup."""
    return _MARKUP.search(content) is not None


def _arguments(raw: Any) -> dict | None:
    """A call's arguments as a dict; None when they are not a JSON object."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError:
            return None
    return raw if isinstance(raw, dict) else None


def valid_call(name: str, args: dict | None, schemas: dict[str, dict]) -> bool:
    """The call names an offered tool and its arguments validate against that tool's schema."""
    import jsonschema

    schema = schemas.get(name)
    if schema is None or args is None:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(args)


def score(case: Case, answer: Answer, check) -> dict:
    """One answer's figures: calls, valid calls, AST verdict, call markup in content."""
    offered = tools(case.functions)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in offered}
    calls = [(name, _arguments(raw)) for name, raw in answer.calls]
    valid = sum(valid_call(name, args, schemas) for name, args in calls)
    if not calls:
        verdict = {"valid": False, "error": [answer.error or "no call"]}
    elif any(args is None for _, args in calls):
        verdict = {"valid": False, "error": ["arguments are not a JSON object"]}
    else:
        verdict = check(case, [{name: args} for name, args in calls])
    return {
        "error": answer.error,
        "calls": len(calls),
        "valid": valid,
        "ast": bool(verdict["valid"]),
        "ast_error": verdict.get("error", []),
        "in_content": call_in_content(answer.content),
        # the answer went on after its calls until max_tokens cut it
        "ran_on": bool(calls) and answer.finish_reason == "length",
        "over_one": one_call(case) and len(calls) > 1,
    }


def summary(scored: list[dict]) -> dict:
    """Shares over one (model, category, arm) cell; ``valid_args`` is over calls (None: none)."""
    n = len(scored)
    calls = sum(s["calls"] for s in scored)

    def share(count: int, of: int) -> float | None:
        return round(count / of, 3) if of else None

    return {
        "answers": n,
        "parsed_call": share(sum(s["calls"] > 0 for s in scored), n),
        "calls": calls,
        "valid_args": share(sum(s["valid"] for s in scored), calls),
        "ast_accuracy": share(sum(s["ast"] for s in scored), n),
        "call_in_content": share(sum(s["in_content"] for s in scored), n),
        "ran_on_after_call": share(sum(s.get("ran_on", False) for s in scored), n),
        "over_one_call": sum(s.get("over_one", False) for s in scored),
        "errors": sum(s["error"] is not None for s in scored),
    }


# ---- asking a server ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arm:
    """One contestant: the server, the mlxd settings file's text, the ``strict`` sent."""

    name: str
    server: str  # mlxd | mlx_lm
    config: str = ""
    strict: bool | None = None


def one_call(case: Case) -> bool:
    """The categories whose answer is one call: asked with ``parallel_tool_calls: false``."""
    return not case.id.startswith("parallel")


def body(case: Case, arm: Arm, max_tokens: int) -> dict:
    return {
        "messages": case.messages,
        "tools": tools(case.functions, arm.strict),
        "tool_choice": "auto",
        "parallel_tool_calls": not one_call(case),
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def answer_of(case_id: str, response: dict) -> Answer:
    """An OpenAI chat completion as an ``Answer``."""
    choice = response["choices"][0]
    message = choice.get("message") or {}
    calls = [
        (c["function"]["name"], c["function"].get("arguments", "{}"))
        for c in message.get("tool_calls") or []
    ]
    return Answer(case_id, message.get("content") or "", calls, choice.get("finish_reason"))


async def ask(client, url: str, case: Case, arm: Arm, max_tokens: int) -> Answer:
    import httpx

    try:
        r = await client.post(f"{url}/v1/chat/completions", json=body(case, arm, max_tokens))
    except httpx.HTTPError as exc:
        return Answer(case.id, error=f"{type(exc).__name__}: {exc}")
    if r.status_code != 200:
        return Answer(case.id, error=f"HTTP {r.status_code}: {r.text[:200]}")
    return answer_of(case.id, r.json())


async def answers(url: str, todo: list[Case], arm: Arm, args) -> list[Answer]:
    """Every case's answer, ``args.concurrency`` requests in flight, in the order given."""
    import httpx
    import trio

    out: list[Answer | None] = [None] * len(todo)
    limiter = trio.CapacityLimiter(args.concurrency)

    async def one(i: int, client) -> None:
        async with limiter:
            out[i] = await ask(client, url, todo[i], arm, args.max_tokens)

    async with httpx.AsyncClient(timeout=args.timeout) as client:
        async with trio.open_nursery() as nursery:
            for i in range(len(todo)):
                nursery.start_soon(one, i, client)
    return [a for a in out if a is not None]


# ---- arms, models, the run ------------------------------------------------------------------


def opt_out_exists() -> bool:
    """Whether this mlxd has the auto-mode constraint setting (and so the constrained arm)."""
    from mlxd.daemon.settings import load_settings

    section = getattr(load_settings(), OPT_OUT[0], None)
    return section is not None and hasattr(section, OPT_OUT[1])


def arms(names: list[str]) -> list[Arm]:
    """The arms asked for that this mlxd has: without the setting, mlxd's default is the
    unconstrained arm and there is no constrained one."""
    section, key = OPT_OUT
    if opt_out_exists():
        table = {
            "constrained": Arm("constrained", "mlxd"),
            "unconstrained": Arm("unconstrained", "mlxd", f"[{section}]\n{key} = false\n"),
        }
    else:
        print(f"mlxd has no {section}.{key}: no constrained arm; the default is unconstrained")
        table = {"unconstrained": Arm("unconstrained", "mlxd")}
    table["mlx_lm"] = Arm("mlx_lm", "mlx_lm")
    return [table[n] for n in names if n in table]


def model_source(name: str) -> str:
    """What ``bench_agents.prepare`` loads for one of ``MODELS``."""
    if name == "smollm2":
        return "default"
    if name == "gemma3":
        from mlxd.scripts.gguf_sample import gemma3_270m

        return str(gemma3_270m(Path("~/.cache/mlxd").expanduser()))
    raise SystemExit(f"unknown model {name!r}: one of {', '.join(MODELS)}")


def run_arm(arm: Arm, model_dir: Path, todo: list[Case], args, tmp: Path) -> list[Answer]:
    """Start ``arm``'s server, send every case (all categories at once, so that a batching
    server batches them), stop it."""
    import trio
    from mlxd.scripts import bench_agents

    config = None
    if arm.config:
        config = tmp / f"{arm.name}.toml"
        config.write_text(arm.config)
    log = tmp / f"{model_dir.name}-{arm.name}.log"
    with bench_agents.serving(arm.server, model_dir, log, args.ready_timeout, config) as (url, s):
        print(f"  {arm.name}: ready in {s:.0f} s", flush=True)
        return trio.run(answers, url, todo, arm, args)


def run_model(model: str, args, check, tmp: Path) -> list[dict]:
    from mlxd.scripts import bench_agents

    model_dir, label = bench_agents.prepare(model_source(model), tmp / model)
    print(f"{model}: {label}", flush=True)
    todo = [case for c in args.categories for case in cases(c, args.limit)]
    rows = []
    for arm in arms(args.arms):
        t0 = time.perf_counter()
        said = run_arm(arm, model_dir, todo, args, tmp)
        scored = [score(case, a, check) for case, a in zip(todo, said, strict=True)]
        _dump(args.answers, model, arm.name, todo, said, scored)
        for category in args.categories:
            mine = [s for case, s in zip(todo, scored, strict=True) if case.category == category]
            row = {"model": model, "category": category, "arm": arm.name, **summary(mine)}
            rows.append(row)
            print(table([row], header=False), flush=True)
        print(f"  ({arm.name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    return rows


def _dump(path: Path | None, model: str, arm: str, todo: list[Case], said, scored) -> None:
    if path is None:
        return
    with path.open("a", encoding="utf-8") as f:
        for case, a, s in zip(todo, said, scored, strict=True):
            line = {"model": model, "category": case.category, "arm": arm, **asdict(a), "score": s}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def rescore(path: Path, check) -> list[dict]:
    """The rows of a dump written by ``--answers``, scored again (the same checker, this
    version's markup scan): a way to look at earlier answers without a server."""
    lines = _jsonl(path)
    known = {c.id: c for cat in {x["category"] for x in lines} for c in cases(cat, 10**6)}
    cells: dict[tuple[str, str, str], list[dict]] = {}
    for x in lines:
        fields = {k: x[k] for k in ("content", "finish_reason", "error")}
        answer = Answer(x["case_id"], calls=[tuple(c) for c in x["calls"]], **fields)
        key = (x["model"], x["category"], x["arm"])
        cells.setdefault(key, []).append(score(known[x["case_id"]], answer, check))
    return [
        {"model": m, "category": c, "arm": a, **summary(scored)}
        for (m, c, a), scored in cells.items()
    ]


# ---- report ---------------------------------------------------------------------------------------

_COLUMNS = (
    ("model", "model", 8),
    ("category", "category", 14),
    ("arm", "arm", 14),
    ("answers", "answers", 7),
    ("parsed_call", "parsed call", 11),
    ("valid_args", "valid args", 10),
    ("ast_accuracy", "AST", 6),
    ("call_in_content", "in content", 10),
    ("ran_on_after_call", "ran on", 7),
    ("over_one_call", ">1 call", 7),
)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{100 * value:.0f}%"
    return str(value)


def table(rows: list[dict], header: bool = True) -> str:
    lines = []
    if header:
        lines.append("  ".join(f"{title:>{w}}" for _, title, w in _COLUMNS))
    for row in rows:
        cells = [f"{_cell(row[key]):>{w}}" for key, _, w in _COLUMNS]
        extra = f"  ({row['calls']} calls)" + (f", {row['errors']} errors" if row["errors"] else "")
        lines.append("  ".join(cells) + extra)
    return "\n".join(lines)


def _list(choices: tuple[str, ...]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{bad or text!r}: choose from {', '.join(choices)}")
        return items

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_list(MODELS), default=list(MODELS))
    p.add_argument("--categories", type=_list(CATEGORIES), default=list(CATEGORIES))
    p.add_argument("--arms", type=_list(ARMS), default=list(ARMS))
    p.add_argument("--limit", type=int, default=20, help="cases per category (the first N)")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight per server")
    p.add_argument("--timeout", type=float, default=900.0, help="HTTP timeout, seconds")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--answers", type=Path, default=None, help="append every answer here (JSONL)")
    p.add_argument("--no-record", action="store_true", help="write no docs/results record")
    p.add_argument(
        "--rescore", type=Path, default=None, help="score a --answers dump again (and record it)"
    )
    return p


def _notes(args) -> str:
    return (
        f"The first {args.limit} cases of each BFCL v4 category, tool_choice auto, greedy, "
        f"max_tokens {args.max_tokens}; parallel_tool_calls false but in 'parallel'. AST "
        "accuracy by bfcl-eval's own checker. valid_args is over the calls made, the other "
        "shares over all answers; ran_on_after_call: answers with a call cut by max_tokens. "
        "A base model: the server is judged by what it guarantees (valid, bounded, ended "
        "calls), not by the model's accuracy."
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    check = checker()
    rows: list[dict] = []
    if args.rescore is not None:  # a dump scored again (recorded unless --no-record)
        rows = rescore(args.rescore, check)
    else:
        with tempfile.TemporaryDirectory(prefix="mlxd-bench-tools-") as tmp:
            for model in args.models:
                rows += run_model(model, args, check, Path(tmp))
    print(table(rows))
    if not args.no_record:
        from mlxd.scripts import records

        argv = [a for a in sys.argv[1:] if not a.startswith("--answers")]
        command = records.command(argv, module="mlxd.scripts.bench_tools")
        peer = "mlx_lm.server" if "mlx_lm" in args.arms else "mlxd without the constraint"
        path = records.write(
            "bench_tools",
            command=command,
            peer=peer,
            against="peer" if "mlx_lm" in args.arms else "itself",
            rows=rows,
            notes=_notes(args),
            model=", ".join(MODEL_NAMES[m] for m in args.models),
            weights="real",
            samples=f"{args.limit} BFCL cases per category, {sum(r['calls'] for r in rows)} calls",
            spread="one greedy run (deterministic)",
        )
        print(f"record: {path}")
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
