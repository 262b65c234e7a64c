"""Models by Hugging Face id (issue 14, item 1): ``ORG/NAME[@revision]`` resolves through
the Hugging Face cache (``HF_HOME``), offline. A fake cache in a tmp ``HF_HOME`` holds
``models--acme--tiny/snapshots/<sha>/`` + ``refs/main`` (the layout ``huggingface_hub``
writes); a loopback HTTP server standing in for the Hub (``HF_ENDPOINT``) records every
request, so "a cached model never touches the network" is checked, not assumed.
huggingface_hub reads its environment once, at import: each check runs in a subprocess.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import httpx
import pytest
from mlxd.actors.engine.loading.sources import model_source
from mlxd.daemon.settings import load_settings

from tests.processes import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
SHA = "0123456789abcdef0123456789abcdef01234567"


def fake_hf_home(root: Path, model_dir: Path, repo: str = "acme/tiny") -> Path:
    """An HF_HOME whose hub cache holds ``repo`` at ``SHA`` (files symlinked from model_dir)."""
    org, name = repo.split("/")
    storage = root / "hub" / f"models--{org}--{name}"
    snapshot = storage / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    for file in model_dir.iterdir():
        (snapshot / file.name).symlink_to(file)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(SHA)
    return root


@pytest.fixture
def placeholder_model(tmp_path) -> Path:
    """Enough of a model directory for resolution (loading is the e2e test's part)."""
    model = tmp_path / "placeholder"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"")
    return model


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The Hub's download API for the repositories in ``repos`` (name -> {file: bytes}), at
    ``SHA``; 404 for anything else. Every request is recorded."""

    requests: list[str]
    repos: dict[str, dict[str, bytes]]

    def do_GET(self):  # noqa: N802 - http.server's name
        self.requests.append(f"{self.command} {self.path}")
        path = urllib.parse.unquote(urllib.parse.urlparse(self.path).path)
        for repo, files in self.repos.items():
            if path.startswith(f"/api/models/{repo}/revision/"):
                siblings = [{"rfilename": name} for name in files]
                return self._send({"id": repo, "sha": SHA, "siblings": siblings})
            if path == f"/api/models/{repo}/tree/{SHA}":
                return self._send([_entry(name, data) for name, data in files.items()])
            name = path.removeprefix(f"/{repo}/resolve/{SHA}/")
            if name in files:
                etag = hashlib.sha1(files[name]).hexdigest()
                return self._send(files[name], {"X-Repo-Commit": SHA, "ETag": f'"{etag}"'})
        return self._send(b"", status=404)

    do_HEAD = do_GET

    def _send(self, body, headers=None, status=200):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def log_message(self, *args):
        pass


def _entry(name: str, data: bytes) -> dict:
    return {"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}


@pytest.fixture
def hub():
    """``(endpoint, requests, repos)``: a loopback stand-in for the Hub (``HF_ENDPOINT``)."""
    requests: list[str] = []
    repos: dict[str, dict[str, bytes]] = {}
    handler = type("Handler", (FakeHub,), {"requests": requests, "repos": repos})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", requests, repos
    finally:
        server.shutdown()


def hub_env(hf_home: Path, endpoint: str | None = None) -> dict[str, str]:
    """The test's environment with this HF_HOME; offline unless an endpoint is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MLXD_"))}
    env["HF_HOME"] = str(hf_home)
    if endpoint is None:
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = endpoint
    return env


RESOLVE = """
import json, sys
from pathlib import Path
from mlxd.actors.engine.loading.load import resolve_model_dir
out = []
for path in sys.argv[1:]:
    try:
        model_id, model_dir = resolve_model_dir(path, Path("/nonexistent-cache"), lambda _: None)
        out.append([model_id, str(model_dir)])
    except FileNotFoundError as exc:
        out.append(["error", str(exc)])
print(json.dumps(out))
"""


def resolve(env: dict[str, str], *paths: str) -> list[list[str]]:
    return resolve_logged(env, *paths)[0]


def resolve_logged(env: dict[str, str], *paths: str) -> tuple[list[list[str]], str]:
    """``resolve_model_dir`` for each path in a fresh process: the results and its stderr."""
    proc = subprocess.run(
        [sys.executable, "-c", RESOLVE, *paths],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc.stderr


@pytest.mark.slow  # runs Python or mlxd as a process
def test_hub_ids_resolve_from_the_hf_cache_offline(tmp_path, placeholder_model):
    home = fake_hf_home(tmp_path / "hf", placeholder_model)
    (broken := tmp_path / "broken").mkdir()
    (broken / "config.json").write_text("{}")  # an interrupted download: no weights
    fake_hf_home(home, broken, "acme/broken")
    snapshot = str(home / "hub" / "models--acme--tiny" / "snapshots" / SHA)
    ids = ["acme/tiny", f"acme/tiny@{SHA}", "acme/tiny@main", "acme/tiny@v2", "acme/missing"]
    got = resolve(hub_env(home), *ids, "acme/broken", str(placeholder_model), "not-a-model")
    assert got[:3] == [["acme/tiny", snapshot]] * 3
    for (kind, message), name in zip(got[3:5], ids[3:5], strict=True):
        assert kind == "error"
        assert message.startswith(f"model not found: {name} (not a local path, not in the")
        assert "HF_HUB_OFFLINE is set" in message
    assert got[5][0] == "error"
    assert "lacks weights (no .safetensors file); an interrupted download?" in got[5][1]
    assert got[6] == ["placeholder", str(placeholder_model)]  # a local directory as before
    assert got[7] == ["error", "model not found: not-a-model (not a local directory, .gguf "
                      "file or Hugging Face id ORG/NAME)"]  # fmt: skip


@pytest.mark.slow  # runs Python or mlxd as a process
def test_a_cached_id_never_touches_the_network_and_a_missing_one_asks_the_hub(
    tmp_path, placeholder_model, hub
):
    endpoint, requests, _ = hub  # a Hub that holds no repository
    home = fake_hf_home(tmp_path / "hf", placeholder_model)
    cached, missing = resolve(hub_env(home, endpoint), "acme/tiny", "acme/missing")
    assert cached[0] == "acme/tiny"
    assert missing[0] == "error" and missing[1].startswith("model not found: acme/missing (")
    assert f"not a local path; from {endpoint}: " in missing[1] and "404" in missing[1]
    assert any("/api/models/acme/missing" in r for r in requests)  # downloads are allowed
    assert not any("tiny" in r for r in requests)  # online, yet the cached id asked nothing


@pytest.mark.slow  # runs Python or mlxd as a process
def test_an_uncached_id_downloads_once_with_progress_then_comes_from_the_cache(
    tmp_path, placeholder_model, hub
):
    endpoint, requests, repos = hub
    weights = {p.name: p.read_bytes() for p in placeholder_model.iterdir()}
    others = {"pytorch_model.bin": b"torch", "tiny-q4.gguf": b"GGUF", "modeling_tiny.py": b"x"}
    repos["acme/tiny"] = weights | others
    repos["acme/torch"] = {"config.json": b"{}"} | others  # no MLX weights
    env = hub_env(tmp_path / "hf", endpoint)
    ((model_id, snapshot), torch), log = resolve_logged(env, "acme/tiny", "acme/torch")
    assert model_id == "acme/tiny"
    assert torch[0] == "error"
    assert "lacks weights (no .safetensors file); not an MLX model repository?" in torch[1]
    assert snapshot == str(tmp_path / "hf" / "hub" / "models--acme--tiny" / "snapshots" / SHA)
    assert sorted(p.name for p in Path(snapshot).iterdir()) == sorted(weights)  # MLX files only
    assert "Fetching 2 files" in log  # huggingface_hub's progress bar, on the console
    asked = len(requests)
    assert asked > 0
    assert resolve(env, "acme/tiny") == [["acme/tiny", snapshot]]
    assert len(requests) == asked  # the second start took it from the cache


@pytest.mark.parametrize(
    ("text", "kind", "repo", "revision"),
    [
        ("acme/tiny", "hub", "acme/tiny", None),
        ("acme/tiny@v1.0", "hub", "acme/tiny", "v1.0"),
        (f"Org-1/Model_2.5-Instruct@{SHA}", "hub", "Org-1/Model_2.5-Instruct", SHA),
        ("acme/tiny.gguf", "missing", "", None),  # a GGUF file that is not there
        ("/models/acme/tiny", "missing", "", None),
        ("./acme/tiny", "missing", "", None),
        ("a/b/c", "missing", "", None),
        ("acme/-tiny", "missing", "", None),
        ("acme/ti--ny", "missing", "", None),
        ("tiny", "missing", "", None),
        ("acme/tiny@", "missing", "", None),
    ],
)
def test_model_source_tells_hub_ids_from_paths(text, kind, repo, revision):
    source = model_source(text)
    assert (source.kind, source.repo, source.revision) == (kind, repo, revision)


def test_an_existing_path_wins_over_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    (tmp_path / "acme" / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.chdir(tmp_path)
    assert model_source("acme/tiny").kind == "local"
    assert model_source("acme/m.gguf").kind == "gguf"


@pytest.mark.parametrize(
    ("overrides", "offline"),
    [
        ({}, True),
        ({"model": {"path": "/some/dir"}}, True),
        ({"model": {"path": "acme/tiny"}}, False),
        ({"speculative": {"draft_model": "acme/draft"}}, False),
        ({"models": [{"id": "a", "path": "acme/tiny@v1"}]}, False),
    ],
)
def test_serve_stays_offline_unless_a_model_is_a_hub_id(monkeypatch, overrides, offline):
    from mlxd.daemon.cli import hub_access

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    hub_access(load_settings(overrides=overrides))
    assert os.environ.get("HF_HUB_OFFLINE") == ("1" if offline else None)


@pytest.mark.slow  # runs Python or mlxd as a process
def test_serve_with_a_missing_hub_id_offline_is_one_line(tmp_path):
    env = hub_env(tmp_path / "empty-hf-home")
    proc = subprocess.run(
        [sys.executable, "-m", "mlxd.daemon.cli", "serve", "acme/missing", "--port", "0"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln]
    assert "model not found: acme/missing (not a local path, not in the Hugging Face cache" in line


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    wait_healthy(base, lambda: proc.poll() is None, timeout, lambda: proc.stdout.read())


@pytest.mark.mlx
@pytest.mark.parametrize("name", ["llama", "qwen2_vl"])
def test_mlxd_serve_org_name_serves_from_the_hf_cache_without_the_network(
    tmp_path, tiny_models, hub, name
):
    """Online (HF_HUB_OFFLINE unset), the cached id is served and the Hub is never asked,
    not by mlx-lm nor by mlx-vlm's processor; the server's chat template (--chat-template)
    is the one that renders the prompt (the tokenizer's, or the vision processor's)."""
    from transformers import AutoTokenizer

    endpoint, requests, _ = hub
    model = tiny_models(name)
    home = fake_hf_home(tmp_path / "hf", model)
    port = free_port()
    template = "{{ messages[-1]['content'] }}"
    argv = ["serve", "acme/tiny", "--port", str(port), "--chat-template", template]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxd.daemon.cli", *argv],
        cwd=tmp_path,
        env=hub_env(home, endpoint),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc)
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["acme/tiny"]
        content = "Once upon a time there was"
        body = {"model": "acme/tiny", "messages": [{"role": "user", "content": content}]}
        reply = httpx.post(f"{base}/v1/chat/completions", json=body | {"max_tokens": 3}, timeout=60)
        assert reply.status_code == 200, reply.text
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        expected = len(tokenizer.encode(content, add_special_tokens=False))
        assert reply.json()["usage"]["prompt_tokens"] == expected
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert requests == [], requests
    assert "using the cached snapshot" in out and "downloading" not in out
