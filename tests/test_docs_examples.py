"""Examples that run: every ``curl`` request on the API pages (``docs/api/*.md``) is sent
to ``mlxd serve`` serving the models the overview's "Examples on these pages" lists
(tiny random-weight ones in their place), and its answer must have the fields and shape
the page shows: a key the page shows is there, with a value of the same kind; a list's
first element is checked against the page's first; a stream has every kind of event the
page shows; a text answer (Prometheus, HTML, …) has each line shown, or for a
Prometheus sample its series. Every route of the app has an example."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from tests.processes import free_port, wait_healthy
from tests.test_docs import _app

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"
PAGES = ("index.md", "openai.md", "anthropic.md", "ollama.md", "llamacpp.md", "mlxd.md")
BASE = "http://127.0.0.1:8000"
WAIT_S = 300.0  # a hang, not a slow machine
# Examples whose answer is an error, and its status (an error shown elsewhere fails).
STATUS = {"index.md › Errors": 403, "ollama.md › Other paths": 404}
# Paths the pages show → the ones the test's daemon has (the LoRA adapter made for its
# tiny chat model, by the daemon fixture).
ADAPTER = "~/adapters/smollm-sql"
PATHS: dict[str, str] = {}
# Routes with no example the test can run, and why (none today).
NOT_RUN: dict[str, str] = {}
FENCE = re.compile(r"^```(\w*)\s*$")
HEADING = re.compile(r"^(#{1,6}) (.+)$")


@dataclass(frozen=True)
class Example:
    title: str  # page › section › subsection
    command: str  # the curl command line
    kind: str  # json or text
    shown: str  # the answer as the page shows it


def _blocks(text: str):
    """A page as headings ``(level, title)`` and fenced blocks ``(lang, body)``, in order,
    with ``None`` for each other non-blank line."""
    lines, i = text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if fence := FENCE.match(line):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            yield ("fence", fence.group(1), "\n".join(lines[i + 1 : end]))
            i = end + 1
            continue
        if heading := HEADING.match(line):
            yield ("heading", len(heading.group(1)), heading.group(2))
        elif line.strip():
            yield ("prose", None, None)
        i += 1


def page_examples(page: str) -> list[Example]:
    """The page's examples: a ``sh`` block running curl, and right after it (blank lines
    only between) a ``json`` or ``text`` block with the answer."""
    out: list[Example] = []
    heads: dict[int, str] = {}
    waiting: tuple[str, str] | None = None  # a curl block's title and command
    for what, a, b in _blocks((API / page).read_text(encoding="utf-8")):
        if waiting is not None:
            assert what == "fence" and a in ("json", "text"), f"{waiting[0]}: no answer after curl"
            title = waiting[0]
            same = sum(e.title.split(" (")[0] == title for e in out)
            out.append(Example(title + (f" ({same + 1})" if same else ""), waiting[1], a, b))
            waiting = None
        elif what == "heading":
            heads = {level: text for level, text in heads.items() if level < a} | {a: b}
        elif what == "fence" and a == "sh" and b.startswith("curl "):
            names = [heads[level] for level in sorted(heads) if level > 1] or [heads.get(1, "")]
            waiting = (" › ".join([page, *names]), b)
    assert waiting is None, f"{waiting[0]}: no answer after curl"
    return out


def examples() -> list[Example]:
    return [e for page in PAGES for e in page_examples(page)]


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
    if isinstance(event.get("stop"), bool):  # llama.cpp
        return "last" if event["stop"] else "chunk"
    return "done" if event.get("done") else "chunk"


def missing_lines(shown: str, answer: str) -> list[str]:
    """The lines of a text answer the page shows that the answer lacks; for a Prometheus
    sample (``name{labels} value``), its series' name."""
    missing = []
    for line in shown.splitlines():
        sample = re.match(r"([a-zA-Z_:][\w:]*)(?=[{ ])", line)
        want = sample.group(1) if sample else line.strip()
        if want and want not in answer:
            missing.append(want)
    return missing


def check(example: Example, answer: httpx.Response) -> list[str]:
    """What in ``answer`` does not match the example's shown answer."""
    title, shown = example.title, example.shown
    if example.kind == "json":
        expected = json.loads(shown)
        wanted = STATUS.get(title, 200)
        error = isinstance(expected, dict) and expected.get("error")
        assert not error or title in STATUS, f"{title}: an error; give its status in STATUS"
        assert answer.status_code == wanted, (title, answer.status_code, answer.text[:500])
        return [f"{title}: {w}" for w in same_shape(expected, answer.json())]
    assert answer.status_code == 200, (title, answer.status_code, answer.text[:500])
    shown_events = events(shown)
    if not shown_events:
        return [
            f"{title}: {line!r} not in the answer" for line in missing_lines(shown, answer.text)
        ]
    got = events(answer.text)
    assert got, (title, answer.text[:300])
    wrong = []
    for event in shown_events:
        like = [e for e in got if kind_of(e) == kind_of(event)]
        if not like:
            wrong.append(f"{title}: no {kind_of(event)!r} event in the stream")
        elif all(same_shape(event, e) for e in like):
            wrong.append(f"{title}: {same_shape(event, like[0])}")
    return wrong


# ---- the pages ----------------------------------------------------------------------------


def test_every_api_page_has_examples_and_every_curl_its_answer():
    by_page = {page: page_examples(page) for page in PAGES}  # asserts each curl has an answer
    assert all(by_page[p] for p in PAGES if p != "index.md"), {
        p: len(e) for p, e in by_page.items()
    }
    assert sum(map(len, by_page.values())) >= 40


def test_every_route_has_an_example():
    app = _app()
    adapter = app.url_map.bind("127.0.0.1:8000")
    covered = set()
    for example in examples():
        method, path, _, _ = request(example.command)
        rule, _ = adapter.match(urlsplit(path).path, method=method, return_rule=True)
        covered.add(rule.rule)
    rules = {r.rule for r in app.url_map.iter_rules() if r.endpoint != "static"}
    missing = sorted(rules - covered - set(NOT_RUN))
    assert not missing, f"routes with no example on docs/api/: {missing}"


def test_the_page_s_example_daemon_is_the_one_the_test_runs():
    """The overview's configuration names the models the examples use."""
    text = (API / "index.md").read_text(encoding="utf-8")
    section = text[text.index("## Examples on these pages") :]
    assert re.findall(r'^id = "(\w+)"', section, flags=re.M) == ["smollm", "embed", "coder"]
    assert "accept_other_ids = true" in section and "max_loaded = 3" in section


# ---- the daemon ---------------------------------------------------------------------------


def _config(tmp: Path, chat: Path, embed: Path, coder: Path | None) -> Path:
    config = tmp / "mlxd.toml"
    text = (
        f'[model]\ncache_dir = "{tmp}"\naccept_other_ids = true\n'
        "[model_pool]\nmax_loaded = 3\n"
        f'[[models]]\nid = "smollm"\npath = "{chat}"\n'
        f'[[models]]\nid = "embed"\npath = "{embed}"\nkind = "embedding"\n'
    )
    if coder is not None:  # Qwen's FIM tokens; speculative with the lookup drafter
        text += f'[[models]]\nid = "coder"\npath = "{coder}"\n'
        text += '[models.speculative]\nenabled = true\ndrafter = "lookup"\n'
    config.write_text(text)
    return config


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_models, smollm_tokenizer, real_tokenizer_model):
    """``mlxd serve`` with the examples' three models; yields its URL and whether the
    ``coder`` model (a real Qwen tokenizer, from ``scripts/install --test``) is served."""
    from mlxd.scripts import tiny_models as tm

    tmp = tmp_path_factory.mktemp("docs-examples")
    embed = tm.build_embedding_model(smollm_tokenizer, tmp / "embed")
    try:
        coder = real_tokenizer_model("qwen35")
    except pytest.skip.Exception:  # no chat templates here (CI fails instead)
        coder = None
    chat = tiny_models("llama")
    config = _config(tmp, chat, embed, coder)
    from tests.test_lora import make_adapter  # the LoRA adapter examples' directory

    PATHS[ADAPTER] = str(make_adapter(chat, tmp / "smollm-sql"))
    port, log = free_port(), tmp / "mlxd.log"
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--port", str(port)]
            + ["--config", str(config)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:
        wait_healthy(url, lambda: proc.poll() is None, WAIT_S, log.read_text)
        yield url, coder is not None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        proc.kill()
        proc.wait()
    assert "Traceback" not in log.read_text()


@pytest.mark.mlx
def test_every_example_answers_with_the_shape_the_page_shows(daemon):
    url, has_coder = daemon
    ids: dict[str, str] = {}  # an id the page shows → the one the daemon gave for it
    wrong, not_run = [], []
    with httpx.Client(base_url=url, timeout=WAIT_S) as http:
        for example in examples():
            if not has_coder and "coder" in example.command:
                not_run.append(example.title)
                continue
            method, path, headers, body = request(example.command)
            for shown_path, real_path in PATHS.items():  # a LoRA adapter's directory
                body = body.replace(shown_path, real_path) if body else body
            for shown_id, real_id in ids.items():  # a stored response's id, …
                path = path.replace(shown_id, real_id)
                body = body.replace(shown_id, real_id) if body else body
            answer = http.request(method, path, headers=headers, content=body)
            wrong += check(example, answer)
            if example.kind == "json" and answer.status_code == 200:
                shown, got = json.loads(example.shown), answer.json()
                if isinstance(shown, dict) and isinstance(got, dict):
                    if isinstance(shown.get("id"), str) and isinstance(got.get("id"), str):
                        ids.setdefault(shown["id"], got["id"])
    assert not wrong, "\n".join(wrong)
    if not_run:
        warnings.warn(f"not run (no coder model: scripts/install --test): {not_run}", stacklevel=1)
