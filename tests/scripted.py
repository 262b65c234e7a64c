"""A real MLX runner that answers from a script, and a server that records what it saw.

The agent-client tests (``tests/test_clients.py``) run real programs (Claude Code,
Codex, ...) against mlxd serving a tiny random-weight model. Its own output is
noise, so each request's answer is scripted: ``ScriptedRunner`` wraps the real
runner and gives every request a grammar that allows exactly the scripted tokens,
then EOS. Everything else is the real path: the chat template, tokenizer, prefix
cache, prefill, batched decode, the grammar mask, detokenizer and tool-call parsers.

``Script`` decides the answer from the rendered prompt: a tool call to a tool the
client offered (in the Hermes markup mlxd asks of templates without tool support,
as SmolLM2's), or, once the last turn holds a tool result, a short text.

``recording_server`` serves the app behind hypercorn with an ASGI wrapper that
keeps every exchange (route, request body, status, response body) for the tests.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import llguidance
import msgspec
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from mlxd.actors.grammar import CompiledGrammar, _llg_tokenizer
from mlxd.daemon.app import create_app
from mlxd.daemon.supervisor import mlx_runner_factory

from tests.conftest import running_graph

FINAL = "Done."

# mlxd's tool description for templates without tool support (actors/tools.py).
_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>\nFor each function call", re.DOTALL)


@dataclass
class Script:
    """The scripted model: one call to the first of ``calls`` (tool name → arguments)
    that the request offers, unless the last turn holds a tool result; then ``final``."""

    calls: dict[str, dict[str, Any]]
    final: str = FINAL

    def reply(self, prompt: str) -> str:
        if last_turn_has_tool_result(prompt):
            return self.final
        offered = offered_tools(prompt)
        for name, arguments in self.calls.items():
            if name in offered:
                call = json.dumps({"name": name, "arguments": arguments})
                return f"<tool_call>\n{call}\n</tool_call>"
        return self.final


def offered_tools(prompt: str) -> set[str]:
    """Names of the tools described in the prompt (mlxd's system-prompt tool list)."""
    found = _TOOLS.search(prompt)
    if not found:
        return set()
    return {json.loads(line)["name"] for line in found.group(1).splitlines() if line.strip()}


def last_turn_has_tool_result(prompt: str) -> bool:
    """Whether a tool result follows the last assistant turn (ChatML: the final
    ``<|im_start|>assistant`` is the generation prompt)."""
    turns = prompt.split("<|im_start|>")[:-1]
    for turn in reversed(turns):
        if turn.startswith("assistant"):
            return False
        if "<tool_response>" in turn:
            return True
    return False


@dataclass
class Started:
    """One request as the runner started it: its prompt, and how much the prefix cache held."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    reply: str


class ScriptedRunner:
    """The real runner, every request constrained to its scripted reply (the runner
    protocol is delegated; ``start`` swaps in the grammar)."""

    def __init__(self, runner: Any, tokenizer: Any, script: Script, prefill_delay_s: float = 0.0):
        self._runner = runner
        self._tokenizer = tokenizer
        self._llt = _llg_tokenizer(tokenizer)
        self.script = script
        self.started: list[Started] = []
        # a request's first prefill step takes this much longer (a long prompt on a big model)
        self._delay = prefill_delay_s
        self._slow: set[str] = set()  # requests whose first prefill step is still to come

    def prefill(self, request_id: str, budget: int) -> int:
        self._first_steps([request_id])
        return self._runner.prefill(request_id, budget)

    def prefill_batch(self, budgets: dict[str, int]) -> dict:
        self._first_steps(list(budgets))
        return self._runner.prefill_batch(budgets)

    def _first_steps(self, request_ids: list[str]) -> None:
        if self._slow.intersection(request_ids):
            self._slow.difference_update(request_ids)
            time.sleep(self._delay)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    def start(self, request: Any) -> int:
        prompt = self._tokenizer.decode(list(request.prompt_tokens))
        reply = self.script.reply(prompt)
        forced = msgspec.structs.replace(request, grammar=self._exactly(reply))
        cached = self._runner.start(forced)
        if self._delay:
            self._slow.add(request.request_id)
        self.started.append(Started(request.request_id, len(request.prompt_tokens), cached, reply))
        return cached

    def _exactly(self, text: str) -> CompiledGrammar:
        """A grammar of exactly ``text``'s tokens (llguidance's ``<[id]>`` token literals)."""
        ids = self._tokenizer.encode(text, add_special_tokens=False)
        lark = "start: " + " ".join(f"<[{i}]>" for i in ids) + "\n"
        matcher = llguidance.LLMatcher(self._llt, llguidance.LLMatcher.grammar_from_lark(lark))
        return CompiledGrammar(matcher, self._llt.vocab_size, tuple(self._llt.eos_tokens))


def scripted_factory(
    settings, script: Script, prefill_delay_s: float = 0.0
) -> Callable[[], tuple[ScriptedRunner, Any]]:
    """The real runner factory of ``settings``, its runner wrapped in a ``ScriptedRunner``."""
    real = mlx_runner_factory(settings)

    def factory():
        runner, info = real()
        return ScriptedRunner(runner, info.tokenizer, script, prefill_delay_s), info

    return factory


@dataclass
class Exchange:
    """One HTTP request and its response, as bytes on the wire (SSE streams whole)."""

    method: str
    path: str
    request: bytes = b""
    status: int = 0
    response: bytes = b""

    @property
    def body(self) -> Any:
        return json.loads(self.request) if self.request else None

    def events(self) -> list[dict]:
        """The ``data:`` payloads of an SSE response (JSON ones)."""
        out = []
        for line in self.response.decode(errors="replace").splitlines():
            if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
                out.append(json.loads(line[5:]))
        return out


@dataclass
class Recorder:
    """ASGI wrapper that keeps every HTTP exchange."""

    app: Any
    exchanges: list[Exchange] = field(default_factory=list)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        query = scope.get("query_string", b"").decode()
        exchange = Exchange(scope["method"], scope["path"] + (f"?{query}" if query else ""))
        self.exchanges.append(exchange)

        async def receive_recorded():
            message = await receive()
            if message["type"] == "http.request":
                exchange.request += message.get("body", b"")
            return message

        async def send_recorded(message):
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                exchange.response += message.get("body", b"")
            await send(message)

        return await self.app(scope, receive_recorded, send_recorded)

    def posts(self, path: str = "") -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path.startswith(path)]


@dataclass
class Served:
    url: str
    recorder: Recorder
    runner: ScriptedRunner
    pipeline: Any


@asynccontextmanager
async def recording_server(
    settings, script: Script, dump: Path | None = None, prefill_delay_s: float = 0.0
):
    """The app on a free loopback port over a scripted real runner; on exit the engine is
    idle. ``dump``: a folder that gets every exchange as a file (for a person to read).
    ``prefill_delay_s``: each prefill step takes this much longer."""
    factory = scripted_factory(settings, script, prefill_delay_s)
    async with running_graph(settings, factory=factory) as (pipeline, runner):
        async with trio.open_nursery() as nursery:
            config = Config()
            config.bind = ["127.0.0.1:0"]
            recorder = Recorder(create_app(pipeline, settings))
            binds = await nursery.start(serve, recorder, config)
            url = binds[0].replace("0.0.0.0", "127.0.0.1")
            try:
                yield Served(url, recorder, runner, pipeline)
            finally:
                if dump is not None:
                    write_exchanges(recorder.exchanges, dump)
            nursery.cancel_scope.cancel()


def write_exchanges(exchanges: list[Exchange], folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, e in enumerate(exchanges, 1):
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{i:02d}_{e.method}_{e.path}")
        (folder / f"{name}.request").write_bytes(e.request)
        (folder / f"{name}.{e.status}").write_bytes(e.response)
