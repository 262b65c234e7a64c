"""Start-up errors (issue 11): one line on stderr, no traceback, a non-zero exit, and
config errors found before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlxd.daemon.settings import SettingsError, load_settings

ROOT = Path(__file__).resolve().parent.parent


def serve(tmp_path, config: str, *args: str) -> tuple[int, str]:
    path = tmp_path / "mlxd.toml"
    path.write_text(f'[model]\ncache_dir = "{tmp_path}"\n' + config)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mlxd.daemon.cli",
            "serve",
            "--config",
            str(path),
            "--port",
            "0",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stderr


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [ln for ln in stderr.splitlines() if "ERROR" in ln or ln.startswith("mlxd:")]
    assert len(errors) == 1, stderr
    return errors[0]


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ('[logging]\nlevel = "LOUD"\n', "logging.level"),
        ('[tokenizer]\ntool_format = "xml"\n', "tokenizer.tool_format"),
        ('[auth]\napi_keys = [""]\n', "auth.api_keys"),
        ('[auth]\napi_keys = ["  "]\n', "auth.api_keys"),
    ],
)
@pytest.mark.slow  # runs mlxd as a process
def test_bad_settings_exit_2_with_one_line_before_the_model_loads(tmp_path, config, field):
    code, stderr = serve(tmp_path, config)
    assert code == 2
    assert field in one_error_line(stderr)
    assert "reading" not in stderr and "loading" not in stderr  # the model was never touched


@pytest.mark.slow  # runs mlxd as a process
def test_a_key_file_with_no_key_exits_1_before_the_model_loads(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# only a comment\n\n")
    code, stderr = serve(tmp_path, f'[auth]\napi_key_file = "{keys}"\n')
    assert code == 1
    assert "holds no key" in one_error_line(stderr)
    assert "reading" not in stderr and "loading" not in stderr


@pytest.mark.slow  # runs mlxd as a process
def test_a_corrupt_gguf_exits_1_with_one_line(tmp_path):
    model = tmp_path / "broken.gguf"
    model.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00garbage" * 64)
    code, stderr = serve(tmp_path, "", str(model))
    assert code == 1
    assert "not a readable GGUF file" in one_error_line(stderr)


@pytest.mark.slow  # runs mlxd as a process
def test_a_corrupt_safetensors_file_exits_1_with_one_line(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    config = {"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1}
    config |= {"intermediate_size": 16, "num_attention_heads": 2, "rms_norm_eps": 1e-5}
    (model / "config.json").write_text(json.dumps(config | {"vocab_size": 32}))
    (model / "model.safetensors").write_bytes(b"\xff" * 500)
    code, stderr = serve(tmp_path, "", str(model))
    assert code == 1
    assert "load_safetensors" in one_error_line(stderr)


@pytest.mark.parametrize(
    "overrides",
    [
        {"logging": {"level": "verbose"}},
        {"tokenizer": {"tool_format": "xml"}},
        {"tokenizer": {"reasoning_tags": "<think>"}},
        {"auth": {"api_keys": ["ok", ""]}},
        {"auth": {"api_keys": ["key "]}},
        {"server": {"allowed_hosts": [""]}},
        {"server": {"max_json_depth": 1}},
    ],
)
def test_settings_refuse_values_that_would_fail_later(overrides):
    with pytest.raises(SettingsError):
        load_settings(None, overrides)


def test_logging_level_is_case_insensitive():
    assert load_settings(None, {"logging": {"level": "debug"}}).logging.level == "DEBUG"
