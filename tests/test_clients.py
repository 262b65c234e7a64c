"""The real agent clients against mlxd: Claude Code, Codex, OpenCode, Qwen Code, aider, llm,
and the OpenAI / Anthropic SDKs with openai-agents.

Each client runs as its users run it (its own config files, a fresh HOME, loopback only)
against mlxd serving a tiny random-weight model with a long context, answers scripted
through the real runner (``tests/scripted.py``): the client's first request gets a call to
one of its own tools, which it executes; the request that carries the result gets "Done.".
The tests assert what the server saw (routes, bodies, the tool round trip, prefix-cache
reuse) and that the client exits 0; the streaming CLIs also run with frequent keep-alive
frames. Clients come from ``scripts/install --test`` (``.clients/``); where one is
missing its test is skipped, except in CI (``CI=true``), where it fails.

Run: ``./scripts/test tests/test_clients.py -m clients -s`` (``-s`` prints each client's
requests and prompt sizes; ``MLXD_CLIENTS_DUMP=DIR`` writes every exchange to DIR).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import NoReturn

import msgspec
import pytest
import trio
from mlxd.daemon.settings import load_settings

from tests.scripted import FINAL, Exchange, Script, Served, recording_server

pytestmark = [pytest.mark.mlx, pytest.mark.clients]

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = ROOT / ".clients"
MODEL = "tiny-agent"  # the served id: the model directory's name
RUN_TIMEOUT = 600  # seconds a client may take (generous: its prompts run to ~15k tokens)
MARKER = "mlxd-client-test-4711"  # the contents of the file a tool call reads


def client(name: str) -> str:
    """A client's executable from ``.clients`` (npm, or a venv of its own), else PATH;
    skipped or failed (in CI) when it is not installed."""
    for folder in (CLIENTS / "node" / "node_modules" / ".bin", CLIENTS / name / "bin"):
        if (folder / name).exists():
            return str(folder / name)
    found = shutil.which(name)
    if found:
        return found
    missing(name)


# Sync fixtures: a skip raised inside a trio test loses its reason.
@pytest.fixture
def claude():
    return client("claude")


@pytest.fixture
def codex():
    return client("codex")


@pytest.fixture
def opencode():
    return client("opencode")


@pytest.fixture
def qwen():
    return client("qwen")


@pytest.fixture
def aider():
    return client("aider")


@pytest.fixture
def llm():
    return client("llm")


@pytest.fixture
def sdk(name):
    """The SDK a ``test_sdk`` case needs, importable."""
    import importlib.util

    if importlib.util.find_spec(name.replace("openai-agents", "agents")) is None:
        missing(f"the {name} package")


def missing(what: str) -> NoReturn:
    """Skip: ``what`` is not installed; in CI (``CI=true``), fail."""
    reason = f"{what} is not installed (scripts/install --test installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def settings(tmp_path_factory, smollm_tokenizer):
    """Default settings, the model being the long-context tiny one."""
    from mlxd.scripts import tiny_models as tm

    model = tm.build_text_model(
        tm.LLAMA_LONG, smollm_tokenizer, tmp_path_factory.mktemp("m") / MODEL
    )
    base = msgspec.to_builtins(load_settings())
    base["model"]["path"] = str(model)
    base["model"]["cache_dir"] = str(tmp_path_factory.mktemp("mlxd-cache"))
    return msgspec.convert(base, type=type(load_settings()))


@pytest.fixture
def home(tmp_path):
    """A fresh HOME and working directory for one client, with a file to read."""
    (tmp_path / "home").mkdir()
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text(f"{MARKER}\n")
    return tmp_path


def dump(home: Path) -> Path | None:
    """Where to write the exchanges: ``MLXD_CLIENTS_DUMP``/<test folder name>, if set."""
    folder = os.environ.get("MLXD_CLIENTS_DUMP")
    return Path(folder) / home.name if folder else None


def base_env(home: Path, **extra: str) -> dict[str, str]:
    """A minimal environment: no proxies, no user config, no telemetry."""
    env = {
        "HOME": str(home / "home"),
        "PATH": os.environ["PATH"],
        "LANG": "C.UTF-8",
        "TERM": "dumb",
        "NO_COLOR": "1",
        "XDG_CONFIG_HOME": str(home / "home" / ".config"),
        "XDG_DATA_HOME": str(home / "home" / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / "home" / ".cache"),
        "XDG_STATE_HOME": str(home / "home" / ".local" / "state"),
    }
    return env | extra


async def run_client(cmd: list[str], env: dict[str, str], cwd: Path, served: Served) -> str:
    """Run a client to completion; its output, and a failure with it (and the requests
    the server refused) unless it exits 0."""
    with trio.fail_after(RUN_TIMEOUT):
        done = await trio.run_process(
            cmd, env=env, cwd=cwd, capture_stdout=True, capture_stderr=True, check=False
        )
    out = done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace")
    refused = "\n".join(failed(served))
    assert done.returncode == 0, f"{cmd[0]} exited {done.returncode}:\n{out[-3000:]}\n{refused}"
    return out


# Keep-alive variants: every request's first prefill step is slowed down to many times
# streaming.keepalive_s, so each stream sends keep-alive frames before its first token
# (Anthropic ``ping`` events, SSE comments for Chat Completions and Responses).
KEEPALIVE = pytest.mark.parametrize("keepalive", [False, True], ids=["plain", "keepalive"])
KEEPALIVE_S = 0.05
SLOW_PREFILL_S = 1.0


def serve(settings, home: Path, script: Script, keepalive: bool):
    """``recording_server`` with default settings, or with frequent keep-alives and slow prefills."""
    if not keepalive:
        return recording_server(settings, script, dump(home))
    base = msgspec.to_builtins(settings)
    base["streaming"]["keepalive_s"] = KEEPALIVE_S
    fast = msgspec.convert(base, type=type(settings))
    return recording_server(fast, script, dump(home), prefill_delay_s=SLOW_PREFILL_S)


def assert_keepalives(served: Served, keepalive: bool) -> None:
    """With keep-alives on, the client got some (and went on, as the other asserts show)."""
    if keepalive:  # an Anthropic stream has one ping after message_start anyway
        kept = [
            e
            for e in served.recorder.exchanges
            if e.response.count(b"event: ping") > 1 or b": keep-alive" in e.response
        ]
        assert kept, "no keep-alive frame in any stream"


def assert_cached_after_tool(served: Served) -> None:
    """The request that carries the tool result (the last one) reuses >= 90% of its prompt
    from the prefix cache: the client resends its history unchanged."""
    last = served.runner.started[-1]
    assert last.cached_tokens >= 0.9 * last.prompt_tokens, last


def report(name: str, served: Served, turns: list[int]) -> None:
    """Print each request the client sent: route, status, prompt tokens, cached tokens
    (the runner's view), grouped by turn (``turns``: requests started before each turn's end)."""
    print(f"\n== {name}")
    exchanges = [e for e in served.recorder.exchanges if e.method == "POST"]
    started = served.runner.started
    for e in exchanges:
        print(f"   POST {e.path} -> {e.status}")
    begin = 0
    for turn, end in enumerate(turns, 1):
        rows = started[begin:end]
        sizes = ", ".join(f"{s.prompt_tokens} ({s.cached_tokens} cached)" for s in rows)
        print(f"   turn {turn}: {len(rows)} model requests; prompt tokens: {sizes}")
        begin = end


def failed(served: Served) -> list[str]:
    """The POSTs that got an error status, with their bodies (for the assertion message)."""
    return [
        f"{e.path} {e.status}: {e.response[:500]!r}"
        for e in served.recorder.exchanges
        if e.method == "POST" and e.status >= 400
    ]


# ---- Claude Code ------------------------------------------------------------------------


def claude_env(home: Path, url: str) -> dict[str, str]:
    return base_env(
        home,
        ANTHROPIC_BASE_URL=url,
        ANTHROPIC_API_KEY="x",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
    )


@KEEPALIVE
async def test_claude_code_two_turns(settings, home, claude, keepalive):
    """``claude -p`` reads a file with its Read tool, then ``--continue`` for a second turn:
    the second turn's prompt comes from the prefix cache (≥ 90%), and Claude Code is told so."""
    work = home / "work"
    script = Script({"Read": {"file_path": str(work / "notes.txt")}})
    async with serve(settings, home, script, keepalive) as served:
        env = claude_env(home, served.url)
        out1 = await run_client([claude, "-p", "Read notes.txt"], env, work, served)
        turn1, sent1 = len(served.runner.started), len(messages_posts(served))
        out2 = await run_client([claude, "-p", "--continue", "Read it again"], env, work, served)
        report("Claude Code", served, [turn1, len(served.runner.started)])
    assert not failed(served), failed(served)
    assert FINAL in out1 and FINAL in out2, (out1, out2)
    assert_keepalives(served, keepalive)
    assert_cached_after_tool(served)
    messages = messages_posts(served)
    first = messages[0].body
    assert first["thinking"]["type"] == "adaptive"
    assert {t["name"] for t in first["tools"]} >= {"Read", "Bash"}
    # the second request carries the Read result (the file's contents) as a tool_result
    results = [
        block
        for m in messages[1].body["messages"]
        if isinstance(m["content"], list)
        for block in m["content"]
        if block.get("type") == "tool_result"
    ]
    assert any(MARKER in json.dumps(r["content"]) for r in results), "no Read result came back"
    # turn 2's first request: the runner took >= 90% of its prompt from the prefix cache,
    # and the client was told so (usage.cache_read_input_tokens)
    first2 = served.runner.started[turn1]
    assert first2.cached_tokens >= 0.9 * first2.prompt_tokens, first2
    usage = message_usage(messages[sent1])
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    prompt += usage.get("cache_creation_input_tokens") or 0
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt, usage


def messages_posts(served: Served) -> list[Exchange]:
    return [e for e in served.recorder.posts("/v1/messages") if "count_tokens" not in e.path]


def message_usage(exchange: Exchange) -> dict:
    """The usage an Anthropic stream reported: message_start's, updated by message_delta's."""
    usage: dict = {}
    for event in exchange.events():
        if event["type"] == "message_start":
            usage.update(event["message"]["usage"])
        elif event["type"] == "message_delta":
            usage.update({k: v for k, v in event.get("usage", {}).items() if v is not None})
    return usage


# ---- Codex CLI --------------------------------------------------------------------------


def codex_config(url: str) -> str:
    return (
        f'model = "{MODEL}"\n'
        'model_provider = "mlxd"\n'
        "[model_providers.mlxd]\n"
        'name = "mlxd"\n'
        f'base_url = "{url}/v1"\n'
        'wire_api = "responses"\n'
    )


@KEEPALIVE
async def test_codex(settings, home, codex, keepalive):
    """``codex exec`` runs ``cat`` through its exec_command tool and gets the output back in a
    function_call_output, over /v1/responses."""
    work = home / "work"
    script = Script(
        {"exec_command": {"cmd": "cat notes.txt"}, "shell": {"command": ["cat", "notes.txt"]}}
    )
    async with serve(settings, home, script, keepalive) as served:
        codex_home = home / "home" / ".codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(codex_config(served.url))
        env = base_env(home, CODEX_HOME=str(codex_home), OPENAI_API_KEY="x")
        cmd = [codex, "exec", "--skip-git-repo-check", "Show notes.txt"]
        out = await run_client(cmd, env, work, served)
        report("Codex", served, [len(served.runner.started)])
    assert not failed(served), failed(served)
    assert FINAL in out, out
    assert_keepalives(served, keepalive)
    assert_cached_after_tool(served)
    calls = served.recorder.posts("/v1/responses")
    tools = calls[0].body["tools"]
    assert {t["type"] for t in tools} >= {"function", "namespace", "web_search"}
    outputs = [i for i in calls[1].body["input"] if i.get("type") == "function_call_output"]
    assert any(MARKER in json.dumps(o) for o in outputs), outputs


# ---- OpenCode ---------------------------------------------------------------------------


def opencode_config(url: str) -> dict:
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            "mlxd": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "mlxd",
                "options": {"baseURL": f"{url}/v1", "apiKey": "x"},
                "models": {MODEL: {"name": MODEL}},
            }
        },
        "model": f"mlxd/{MODEL}",
        "autoupdate": False,
        "share": "disabled",
    }


@KEEPALIVE
async def test_opencode(settings, home, opencode, keepalive):
    """``opencode run`` reads a file with its read tool over /v1/chat/completions."""
    work = home / "work"
    script = Script({"read": {"filePath": str(work / "notes.txt")}})
    async with serve(settings, home, script, keepalive) as served:
        (work / "opencode.json").write_text(json.dumps(opencode_config(served.url)))
        quiet = ("AUTOUPDATE", "MODELS_FETCH", "DEFAULT_PLUGINS", "LSP_DOWNLOAD", "CLAUDE_CODE")
        env = base_env(home, **{f"OPENCODE_DISABLE_{what}": "1" for what in quiet})
        out = await run_client([opencode, "run", "Show notes.txt"], env, work, served)
        report("OpenCode", served, [len(served.runner.started)])
    assert not failed(served), failed(served)
    assert FINAL in out, out
    assert_tool_round_trip(served)
    assert_keepalives(served, keepalive)
    assert_cached_after_tool(served)


def assert_tool_round_trip(served: Served) -> None:
    """Chat Completions: the first request offers tools, a later one carries the tool
    message with the file's contents."""
    chats = served.recorder.posts("/v1/chat/completions")
    assert any(e.body.get("tools") for e in chats), [e.path for e in served.recorder.exchanges]
    results = [m for e in chats for m in e.body["messages"] if m["role"] == "tool"]
    assert any(MARKER in json.dumps(m["content"]) for m in results), results


# ---- Qwen Code --------------------------------------------------------------------------


@KEEPALIVE
async def test_qwen_code(settings, home, qwen, keepalive):
    """``qwen -p`` reads a file with its read_file tool over /v1/chat/completions."""
    work = home / "work"
    script = Script({"read_file": {"file_path": str(work / "notes.txt")}})
    async with serve(settings, home, script, keepalive) as served:
        env = base_env(
            home, OPENAI_BASE_URL=f"{served.url}/v1", OPENAI_API_KEY="x", OPENAI_MODEL=MODEL
        )
        out = await run_client([qwen, "-p", "Show notes.txt"], env, work, served)
        report("Qwen Code", served, [len(served.runner.started)])
    assert not failed(served), failed(served)
    assert FINAL in out, out
    assert_tool_round_trip(served)
    assert_keepalives(served, keepalive)
    assert_cached_after_tool(served)


# ---- aider ------------------------------------------------------------------------------


async def test_aider(settings, home, aider):
    """``aider --message``: one chat turn (aider edits through text, it offers no tools)."""
    work = home / "work"
    async with recording_server(settings, dump=dump(home), script=Script({})) as served:
        # litellm's model price list comes with it, not from GitHub
        env = base_env(home, OPENAI_API_KEY="x", LITELLM_LOCAL_MODEL_COST_MAP="True")
        cmd = [
            aider,
            "--message", "Say done.",
            "--openai-api-base", f"{served.url}/v1",
            "--model", f"openai/{MODEL}",
            "--no-git", "--yes-always", "--no-check-update", "--no-show-model-warnings",
            "--analytics-disable", "--no-pretty", "--no-stream",
        ]  # fmt: skip
        out = await run_client(cmd, env, work, served)
        report("aider", served, [len(served.runner.started)])
    assert not failed(served), failed(served)
    assert FINAL in out, out
    assert served.recorder.posts("/v1/chat/completions")


# ---- llm --------------------------------------------------------------------------------


async def test_llm(settings, home, llm):
    """``llm`` with mlxd registered in extra-openai-models.yaml, calling its llm_version tool."""
    work = home / "work"
    user_dir = home / "home" / "llm"
    user_dir.mkdir()
    async with recording_server(
        settings, dump=dump(home), script=Script({"llm_version": {}})
    ) as served:
        (user_dir / "extra-openai-models.yaml").write_text(
            f"- model_id: {MODEL}\n"
            f"  model_name: {MODEL}\n"
            f"  api_base: {served.url}/v1\n"
            "  supports_tools: true\n"
        )
        env = base_env(home, LLM_USER_PATH=str(user_dir), OPENAI_API_KEY="x")
        cmd = [llm, "-m", MODEL, "-T", "llm_version", "Which llm version is this?"]
        out = await run_client(cmd, env, work, served)
        report("llm", served, [len(served.runner.started)])
    assert not failed(served), failed(served)
    assert FINAL in out, out
    chats = served.recorder.posts("/v1/chat/completions")
    results = [m for e in chats for m in e.body["messages"] if m["role"] == "tool"]
    assert results, [e.body for e in chats]


# ---- SDKs -------------------------------------------------------------------------------

OPENAI_SDK = """
import json, sys
from openai import OpenAI
client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="x")
tools = [{"type": "function", "function": {"name": "read_notes", "parameters": {"type": "object", "properties": {}}}}]
messages = [{"role": "user", "content": "Read my notes."}]
first = client.chat.completions.create(model=sys.argv[2], messages=messages, tools=tools)
call = first.choices[0].message.tool_calls[0]
messages += [first.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": sys.argv[3]}]
stream = client.chat.completions.create(model=sys.argv[2], messages=messages, tools=tools, stream=True)
print("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
"""

ANTHROPIC_SDK = """
import sys
import anthropic
client = anthropic.Anthropic(base_url=sys.argv[1], api_key="x")
tools = [{"name": "read_notes", "input_schema": {"type": "object", "properties": {}}}]
messages = [{"role": "user", "content": "Read my notes."}]
first = client.messages.create(model=sys.argv[2], max_tokens=200, messages=messages, tools=tools)
use = next(b for b in first.content if b.type == "tool_use")
messages += [{"role": "assistant", "content": first.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": sys.argv[3]}]}]
with client.messages.stream(model=sys.argv[2], max_tokens=200, messages=messages, tools=tools) as stream:
    print(stream.get_final_text())
"""

AGENTS_SDK = """
import sys
from agents import Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI
set_tracing_disabled(True)
@function_tool
def read_notes() -> str:
    "Read the user's notes."
    return sys.argv[3]
client = AsyncOpenAI(base_url=sys.argv[1] + "/v1", api_key="x")
for kind in (OpenAIChatCompletionsModel, OpenAIResponsesModel):
    agent = Agent(name="a", instructions="Be brief.", tools=[read_notes],
                  model=kind(model=sys.argv[2], openai_client=client))
    print(Runner.run_sync(agent, "Read my notes.").final_output)
"""


@pytest.mark.parametrize(
    ("name", "source", "route"),
    [
        ("openai", OPENAI_SDK, "/v1/chat/completions"),
        ("anthropic", ANTHROPIC_SDK, "/v1/messages"),
        ("openai-agents", AGENTS_SDK, "/v1/responses"),
    ],
)
async def test_sdk(settings, home, sdk, name, source, route):
    """The official SDKs (and openai-agents over Chat Completions and Responses): a tool call,
    its result sent back, a streamed final answer."""
    import sys

    script_file = home / "client.py"
    script_file.write_text(source)
    async with recording_server(
        settings, dump=dump(home), script=Script({"read_notes": {}})
    ) as served:
        env = base_env(home)
        cmd = [sys.executable, str(script_file), served.url, MODEL, MARKER]
        out = await run_client(cmd, env, home / "work", served)
        report(f"{name} SDK", served, [len(served.runner.started)])
    assert not failed(served), failed(served)
    assert out.count(FINAL) >= (2 if name == "openai-agents" else 1), out
    assert served.recorder.posts(route)
    assert MARKER in served.recorder.posts(route)[-1].request.decode()
