"""The `mlxd` process: start-up failures and graceful drain on SIGTERM."""

from __future__ import annotations

import json
import os
import plistlib
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlxd.daemon.cli import _parser
from mlxd.daemon.service import render_plist, spec_from_args

from tests.processes import free_port

ROOT = Path(__file__).resolve().parent.parent


def mlxd(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "mlxd.daemon.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


@pytest.mark.slow  # runs mlxd as a process
def test_missing_model_exits_nonzero_with_one_clear_line():
    proc = mlxd("serve", "/nonexistent/model.gguf", "--port", str(free_port()))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    errors = [line for line in out.splitlines() if "ERROR" in line]
    assert len(errors) == 1
    assert "model not found: /nonexistent/model.gguf" in errors[0]
    assert "Traceback" not in out


@pytest.mark.slow  # runs mlxd as a process
def test_bad_config_exits_nonzero(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nprot = 1\n")
    proc = mlxd("serve", "--config", str(config))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "prot" in out


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def launchd_job(*argv: str) -> dict:
    """The LaunchAgent ``mlxd launchd install`` would write, parsed."""
    args = _parser().parse_args(["launchd", "install", "--print", *argv])
    return plistlib.loads(render_plist(spec_from_args(args)).encode())


@pytest.mark.mlx
def test_sigterm_drains_in_flight_request_then_exits_zero(tmp_path):
    """Started as the LaunchAgent starts it, stopped as launchd stops it (SIGTERM)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = tmp_path / "c.toml"
    # the drain's deadline is long enough for 40 tokens on a busy machine (under
    # scripts/test --under-load 4, 30 s was not); launchd's ExitTimeOut follows it
    config.write_text(f'[server]\ndrain_timeout_s = 300.0\n[model]\ncache_dir = "{tmp_path}"\n')
    job = launchd_job("--port", str(port), "--config", str(config))
    assert job["ExitTimeOut"] > 300
    proc = subprocess.Popen(
        job["ProgramArguments"],
        cwd=job["WorkingDirectory"],
        env={**os.environ, **job["EnvironmentVariables"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # a bound, not a timing: loading and warming the model on a busy 2-core machine
        # (scripts/test --under-load 4) took longer than the 120 s this once allowed
        deadline, ready = time.time() + 600, False
        while time.time() < deadline and not ready:
            try:
                ready = _get(f"{base}/health")[0] == 200
            except OSError:
                pass
            time.sleep(0.2)
        assert ready, "the daemon never became ready"
        body = json.dumps(
            {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stream": True}
        )
        req = urllib.request.Request(
            f"{base}/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        conn = urllib.request.urlopen(req, timeout=300)  # noqa: SIM115 - headers are in: it runs
        proc.send_signal(signal.SIGTERM)
        frames = [f for f in conn.read().decode().split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        last = json.loads(frames[-2][6:])
        assert last.get("choices", [{}])[0].get("finish_reason") == "length", frames[-2]
        out, _ = proc.communicate(timeout=job["ExitTimeOut"])  # before launchd's SIGKILL
        assert proc.returncode == 0
        assert "draining" in out
        (line,) = [ln for ln in out.splitlines() if "mlxd.requests" in ln]
        assert (
            "status=200" in line
            and "generated_tokens=40" in line
            and "finish_reason=length" in line
        )
    finally:
        proc.kill()


@pytest.mark.slow  # runs mlxd as a process
def test_unreadable_api_key_file_exits_nonzero_with_one_clear_line(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[auth]\napi_key_file = "{tmp_path}/missing-keys"\n')
    proc = mlxd("serve", "--port", str(free_port()), "--config", str(config))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    (error,) = [line for line in out.splitlines() if "ERROR" in line]
    assert "auth.api_key_file: cannot read" in error and "missing-keys" in error
    assert "Traceback" not in out


# ---- flags, environment, `mlxd config` (issue 14, item 6) ---------------------------------


def _setting(settings, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(settings, section), key)


def effective(*argv: str, command: str = "serve"):
    from mlxd.daemon.cli import effective_settings

    return effective_settings(_parser().parse_args([command, *argv]))


# flag -> (its arguments, the settings they set)
FLAG_CASES = {
    "--host": (["--host", "0.0.0.0"], {"server.host": "0.0.0.0"}),
    "--port": (["--port", "9001"], {"server.port": 9001}),
    "--kind": (["--kind", "vision"], {"model.kind": "vision"}),
    "--served-model-name": (["--served-model-name", "gpt-x"], {"model.served_id": "gpt-x"}),
    "--chat-template": (["--chat-template", "t.jinja"], {"model.chat_template": "t.jinja"}),
    "--adapter": (
        ["--adapter", "sql=/a/sql", "--adapter", "chat=/a/chat"],
        {"model.adapters": {"sql": "/a/sql", "chat": "/a/chat"}},
    ),
    "--api-key": (["--api-key", "k1", "--api-key", "k2"], {"auth.api_keys": ["k1", "k2"]}),
    "--max-num-seqs": (
        ["--max-num-seqs", "5"],
        {"engine.max_batch": 5, "admission.max_running": 5},
    ),
    "--max-tokens": (["--max-tokens", "77"], {"engine.default_max_tokens": 77}),
    "--draft-model": (
        ["--draft-model", "acme/draft"],
        {
            "speculative.draft_model": "acme/draft",
            "speculative.enabled": True,
            "speculative.drafter": "draft_model",
        },
    ),
    "--num-draft-tokens": (["--num-draft-tokens", "5"], {"speculative.num_draft_tokens": 5}),
    "--log-level": (["--log-level", "warning"], {"logging.level": "WARNING"}),
    "--parallel": (["--parallel", "pipeline"], {"distributed.parallel": "pipeline"}),
}


@pytest.fixture
def clean_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith("MLXD_"):
            monkeypatch.delenv(name)
    return monkeypatch


def test_every_flag_in_the_table_has_a_case():
    from mlxd.daemon.cli import FLAGS

    assert set(FLAG_CASES) == {flag.name for flag in FLAGS}


@pytest.mark.parametrize("command", ["serve", "config"])
@pytest.mark.parametrize("flag", sorted(FLAG_CASES))
def test_each_flag_lands_in_the_effective_settings(clean_env, flag, command):
    argv, expected = FLAG_CASES[flag]
    settings, defaults = effective(*argv, command=command), effective(command=command)
    for dotted, value in expected.items():
        assert _setting(settings, dotted) == value != _setting(defaults, dotted)


def test_the_model_argument_is_model_path(clean_env):
    assert effective("acme/tiny@v2").model.path == "acme/tiny@v2"
    assert effective().model.path == ""


def test_flags_beat_the_environment_which_beats_the_file(clean_env, tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[server]\nport = 1001\n[engine]\nmax_batch = 3\ndefault_max_tokens = 9\n")
    clean_env.setenv("MLXD_SERVER__PORT", "1002")
    clean_env.setenv("MLXD_ENGINE__MAX_BATCH", "8")
    s = effective("--config", str(config), "--port", "1003")
    assert (s.server.port, s.engine.max_batch, s.engine.default_max_tokens) == (1003, 8, 9)
    assert effective("--config", str(config)).server.port == 1002


def test_trust_remote_code_is_refused_with_a_reason(clean_env):
    from mlxd.daemon.settings import SettingsError

    with pytest.raises(SettingsError, match="--trust-remote-code is not supported"):
        effective("--trust-remote-code")


def run_cli(*args: str, env: dict | None = None, cwd=ROOT) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MLXD_")}
    return subprocess.run(
        [sys.executable, "-m", "mlxd.daemon.cli", *args],
        cwd=cwd,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_mlxd_config_prints_the_effective_settings_as_toml(tmp_path):
    import msgspec
    from mlxd.daemon.settings import Settings

    config = tmp_path / "c.toml"
    config.write_text('[server]\nport = 1001\n[model]\nserved_id = "from-file"\n')
    env = {"MLXD_ENGINE__MAX_BATCH": "8", "MLXD_SERVER__PORT": "1002"}
    argv = ["config", "--config", str(config), "--port", "1003", "--api-key", "secret"]
    proc = run_cli(*argv, "--draft-model", "acme/draft", env=env)
    assert proc.returncode == 0, proc.stderr
    printed = msgspec.toml.decode(proc.stdout)
    assert "secret" not in proc.stdout and printed["auth"]["api_keys"] == ["***"]
    printed["auth"]["api_keys"] = ["secret"]
    s = msgspec.convert(printed, type=Settings)  # the whole tree, loadable as a config file
    assert (s.server.port, s.engine.max_batch, s.model.served_id) == (1003, 8, "from-file")
    assert s.speculative.enabled and s.speculative.draft_model == "acme/draft"


@pytest.mark.parametrize(
    ("args", "env", "code", "message"),
    [
        (["serve"], {"MLXD_SERVER__PORT": "eighty"}, 2, "MLXD_SERVER__PORT='eighty'"),
        (["config"], {"MLXD_SERVR__PORT": "1"}, 2, "MLXD_SERVR__PORT: no such setting"),
        (["serve", "--trust-remote-code"], {}, 2, "--trust-remote-code is not supported"),
        (["serve", "--chat-template", "/nonexistent/t.jinja"], {}, 1, "model.chat_template"),
        (["serve", "--log-level", "loud"], {}, 2, "logging.level"),
    ],
)
def test_bad_flags_and_environment_stop_start_up_with_one_line(args, env, code, message):
    proc = run_cli(*args, "--port", "0", env=env)
    assert proc.returncode == code
    assert "Traceback" not in proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if "ERROR" in ln or ln.startswith("mlxd:")]
    assert message in line
    assert "loading" not in proc.stderr  # the model was never touched


# ---- the server's chat template (--chat-template) -------------------------------------------


def word_tokenizer():
    """A real Hugging Face fast tokenizer over a few words, with a chat template of its own."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<eos>", "hi", "there", "<", ">", "[", "]"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    return tokenizer


def prompt_builder(chat_template: str):
    from mlxd.actors.engine.scheduler.types import ModelInfo
    from mlxd.actors.grammar import GrammarCompiler
    from mlxd.actors.tokenizer import PromptBuilder, TokenizerOptions

    tokenizer = word_tokenizer()
    info = ModelInfo("m", Path("."), 4096, len(tokenizer), tokenizer, "cpu")
    options = TokenizerOptions(chat_template=chat_template)
    return PromptBuilder.for_model(info, options, GrammarCompiler(None))


def test_the_servers_chat_template_replaces_the_models():
    from tests.conftest import chat

    request = chat("r", "hi there")
    own = prompt_builder("").render_chat(request)[0]
    assert own == "<user>hi there"
    server = "{% for m in messages %}[{{ m.content }}]{% endfor %}{% if tools %}T{% endif %}"
    builder = prompt_builder(server)
    assert builder.render_chat(request)[0] == "[hi there]"
    assert builder.traits.tools_in_template  # the traits are read from the server's template
    assert not prompt_builder("").traits.tools_in_template
