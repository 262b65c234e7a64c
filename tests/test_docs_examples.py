"""Examples that run: every ``curl`` request on ``docs/examples.md`` is sent to a daemon
serving a tiny model, and its answer must have the fields and shape the page shows (a
key the page shows is there, with a value of the same kind; a list's first element is
checked against the page's first; a stream has every kind of event the page shows)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import httpx
import pytest
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import mlx_runner_factory

from tests.conftest import real_server

pytestmark = pytest.mark.mlx

PAGE = Path(__file__).resolve().parent.parent / "docs" / "examples.md"
BASE = "http://127.0.0.1:8000"
BLOCK = re.compile(
    r"^### (.+?)\n.*?```sh\n(curl .*?)\n```\s*\n```(json|text)\n(.*?)\n```", re.M | re.S
)


def examples() -> list[tuple[str, str, str, str]]:
    return BLOCK.findall(PAGE.read_text(encoding="utf-8"))


def request(command: str) -> tuple[str, str, dict[str, str], str | None]:
    """A curl command line as (method, path, headers, body)."""
    args = shlex.split(command.replace("\\\n", " "))
    assert args[0] == "curl"
    headers, body, url, method = {}, None, None, None
    i = 1
    while i < len(args):
        arg = args[i]
        if arg in ("-H", "--header"):
            name, _, value = args[i + 1].partition(":")
            headers[name.strip()] = value.strip()
            i += 2
        elif arg in ("-d", "--data"):
            body = args[i + 1]
            i += 2
        elif arg == "-X":
            method = args[i + 1]
            i += 2
        elif arg.startswith("-"):
            i += 1  # -N, -s: how curl prints, not what it sends
        else:
            url = arg
            i += 1
    assert url and url.startswith(BASE), url
    return method or ("POST" if body is not None else "GET"), url[len(BASE) :], headers, body


def same_shape(shown, actual, where: str = "") -> list[str]:
    """Where ``actual`` lacks a key ``shown`` has, or holds another kind of value."""
    if shown is None:
        return []
    if isinstance(shown, dict):
        if not isinstance(actual, dict):
            return [f"{where}: an object on the page, {type(actual).__name__} in the answer"]
        wrong = []
        for key, value in shown.items():
            if key not in actual:
                wrong.append(f"{where}.{key}: missing")
            else:
                wrong += same_shape(value, actual[key], f"{where}.{key}")
        return wrong
    if isinstance(shown, list):
        if not isinstance(actual, list):
            return [f"{where}: a list on the page"]
        return same_shape(shown[0], actual[0], f"{where}[0]") if shown and actual else []
    kind = (
        (bool,)
        if isinstance(shown, bool)
        else (int, float)
        if isinstance(shown, (int, float))
        else (str,)
    )
    if actual is not None and not isinstance(actual, kind):
        return [
            f"{where}: {type(shown).__name__} on the page, {type(actual).__name__} in the answer"
        ]
    return []


def events(text: str) -> list:
    """The JSON events of an SSE or NDJSON stream."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
        elif line.startswith("{"):
            out.append(json.loads(line))
    return out


def kind_of(event: dict) -> str:
    if "type" in event:
        return str(event["type"])
    if "object" in event:
        return str(event["object"])
    return "done" if event.get("done") else "chunk"


@pytest.fixture(scope="module")
def settings(tiny_models, tmp_path_factory):
    path = str(tiny_models("llama"))
    cache = str(tmp_path_factory.mktemp("mlxd-cache"))
    return load_settings(None, {"model": {"path": path, "cache_dir": cache}})


def test_the_page_has_an_example_per_api():
    names = [e[0] for e in examples()]
    assert len(names) >= 12, names
    text = PAGE.read_text(encoding="utf-8")
    for api in ("## OpenAI", "## Anthropic", "## Ollama", "## llama.cpp", "## mlxd's own"):
        assert api in text


async def test_every_example_answers_with_the_shape_the_page_shows(settings):
    wrong = []
    async with real_server(settings, mlx_runner_factory(settings)) as (url, _, _):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            for title, command, kind, shown in examples():
                method, path, headers, body = request(command)
                answer = await http.request(method, path, headers=headers, content=body)
                if kind == "json":
                    expected = json.loads(shown)
                    wanted = 403 if "error" in expected else 200
                    assert answer.status_code == wanted, (title, answer.text)
                    wrong += [f"{title}: {w}" for w in same_shape(expected, answer.json())]
                    continue
                assert answer.status_code == 200, (title, answer.text)
                got = events(answer.text)
                assert got, (title, answer.text[:300])
                for event in events(shown):
                    like = [e for e in got if kind_of(e) == kind_of(event)]
                    if not like:
                        wrong.append(f"{title}: no {kind_of(event)!r} event in the stream")
                    elif all(same_shape(event, e) for e in like):
                        wrong.append(f"{title}: {same_shape(event, like[0])}")
    assert not wrong, "\n".join(wrong)
